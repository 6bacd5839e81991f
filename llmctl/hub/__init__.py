"""Models from the Hugging Face hub: ``llmctl pull / ls / rm`` on the standard HF cache.

Everything lives in the cache that ``huggingface_hub`` itself uses (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), in its usual layout, so models that
transformers, vLLM or ``hf download`` already fetched are reused, and what llmctl fetches is
reused by them. One module per concern:

- ``layout``: the cache directory, its layout, which files inference needs;
- ``refs``: ``ORG/NAME[@REVISION]`` parsed and found in the cache; ``resolve``: MODEL arguments;
- ``download`` (with ``progress``, ``checksums``, ``errors``): ``pull``, resumable and verified;
- ``listing``: ``ls`` (``scan_cache_dir``); ``removal``: ``rm`` (``delete_revisions``);
- ``cli``: the three commands.

huggingface_hub itself is imported only inside the functions that use it (it takes longer to
import than the rest of ``llmctl --help``).
"""

from llmctl.hub.cli import register_hub_commands
from llmctl.hub.download import pull
from llmctl.hub.layout import hub_cache_dir, hub_endpoint, select_inference_files
from llmctl.hub.listing import CachedModel, list_models, safetensors_stats
from llmctl.hub.refs import find_cached_snapshot, parse_model_ref
from llmctl.hub.removal import remove
from llmctl.hub.resolve import resolve_model_dir

__all__ = [
    "CachedModel",
    "find_cached_snapshot",
    "hub_cache_dir",
    "hub_endpoint",
    "list_models",
    "parse_model_ref",
    "pull",
    "register_hub_commands",
    "remove",
    "resolve_model_dir",
    "safetensors_stats",
    "select_inference_files",
]
