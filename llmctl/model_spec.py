"""What a MODEL argument names, resolved to what the loader reads.

Its own module because both the command line (``llmctl.cli_options``) and the parallel launcher
(``llmctl.parallel.launch``, which checks a model can be split before any rank starts) resolve
MODEL, and neither may import the other.
"""

from __future__ import annotations

from llmctl.config import EMBEDDED_MODEL_NAME
from llmctl.models.gguf_files import resolve_gguf_spec


def resolve_model(spec: str, *, allow_pull: bool | None = None) -> str:
    """The embedded name, a packaged GGUF model's short name, a ``.gguf`` file, a local directory,
    or a hub id found in (or pulled into) the HF cache."""
    if spec == EMBEDDED_MODEL_NAME:
        return spec
    if (gguf_file := resolve_gguf_spec(spec)) is not None:
        return str(gguf_file)
    from llmctl.hub import resolve_model_dir

    return str(resolve_model_dir(spec, allow_pull=allow_pull))
