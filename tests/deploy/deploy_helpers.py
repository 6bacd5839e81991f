"""Rendering the Kubernetes manifests with the real kustomize, and the isolated checkov."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES_DIR / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
CHECKOV_VERSION = "3.3.30"
# checkov pins old networkx/packaging that would downgrade torch's: it gets a venv of its own
CHECKOV_VENV = Path(os.environ.get("LLMCTL_CHECKOV_VENV", Path.home() / ".cache" / "llmctl-checkov"))


def kustomize_command() -> list[str]:
    """The standalone kustomize, else kubectl's built-in one (kubectl >= 1.14 has it)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    message = "neither kustomize nor kubectl is installed: the manifests cannot be rendered"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def render(overlay: str) -> str:
    result = subprocess.run(
        [*kustomize_command(), str(KUBERNETES_DIR / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def checkov_binary() -> Path:
    """checkov in its own venv, installed from PyPI on first use (a minute or two)."""
    binary = CHECKOV_VENV / "bin" / "checkov"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(CHECKOV_VENV / "bin" / "pip"), "install", "-q", f"checkov=={CHECKOV_VERSION}"], check=True, timeout=900
        )
    return binary
