"""What huggingface_hub (or the network) raised, as one actionable line."""

from __future__ import annotations

import json
import os

from llmctl.errors import HubError, LlmctlError, ModelNotFoundError
from llmctl.hub.layout import DEFAULT_REVISION, endpoint_label, hub_cache_dir, hub_endpoint


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception classes of whichever HTTP client huggingface_hub uses."""
    found: list[type[BaseException]] = []
    for module_name in ("httpx2", "httpx"):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in ("ConnectError", "TimeoutException", "RemoteProtocolError", "NetworkError", "ProxyError"):
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                found.append(cls)
    try:
        import requests  # type: ignore[import-untyped]

        found += [requests.ConnectionError, requests.Timeout]
    except ImportError:
        pass
    return tuple(found)


def is_unreachable(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled) or isinstance(exc, _network_errors()):
        return True
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is not None and status >= 500
    return False


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def translate_error(
    exc: BaseException,
    *,
    repo_id: str,
    revision: str | None,
    token: str | None,
    filename: str | None = None,
) -> LlmctlError:
    """An actionable ``HubError`` for what huggingface_hub (or the network) raised."""
    from huggingface_hub import errors as hfe

    endpoint = hub_endpoint()
    rev = revision or DEFAULT_REVISION
    what = f"{filename} of {repo_id}@{rev}" if filename else f"{repo_id}@{rev}"
    if isinstance(exc, LlmctlError):
        return exc
    if isinstance(exc, hfe.OfflineModeIsEnabled):
        return HubError(
            f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded from {endpoint}; "
            "unset HF_HUB_OFFLINE or use a model already in the cache (`llmctl ls`)"
        )
    if isinstance(exc, hfe.GatedRepoError):
        hint = (
            "the token in use has no access: accept the licence on the model page with that account"
            if token or os.environ.get("HF_TOKEN")
            else "accept its licence on the model page, then set HF_TOKEN (or pass --token) to a token of that account"
        )
        return HubError(f"{repo_id} is a gated repository on {endpoint}: {hint}")
    if isinstance(exc, hfe.RepositoryNotFoundError):
        return HubError(
            f"repository {repo_id} not found on {endpoint} (check the id, or HF_TOKEN for gated/private repos)"
        )
    if isinstance(exc, hfe.RevisionNotFoundError):
        return HubError(
            f"revision {rev!r} not found in {repo_id} on {endpoint} (check the branch, tag or commit after '@')"
        )
    if isinstance(exc, hfe.RemoteEntryNotFoundError):
        return HubError(f"{what} is listed by {endpoint} but could not be downloaded (404)")
    if isinstance(exc, _network_errors()):
        reason = str(exc) or type(exc).__name__
        return HubError(
            f"could not reach the Hugging Face hub at {endpoint} ({endpoint_label()}): {reason}; "
            "check the network connection or HF_ENDPOINT (models already in the cache still work: `llmctl ls`)"
        )
    if isinstance(exc, hfe.HfHubHTTPError):
        status = _status(exc)
        if status == 401:
            return HubError(f"{endpoint} refused the credentials for {what} (HTTP 401): check HF_TOKEN / --token")
        if status == 403:
            return HubError(
                f"{endpoint} denied access to {what} (HTTP 403): the token lacks permission; "
                "for a gated model accept its licence on the model page"
            )
        if status == 404:
            return HubError(
                f"repository {repo_id} (revision {rev!r}) not found on {endpoint} "
                "(check the id, or HF_TOKEN for gated/private repos)"
            )
        if status == 429:
            return HubError(f"{endpoint} is rate-limiting requests (HTTP 429); wait a minute and retry")
        if status is not None and status >= 500:
            return HubError(f"{endpoint} failed with HTTP {status} while fetching {what}; retry later")
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return HubError(f"{endpoint} refused {what}: {first_line}")
    if isinstance(exc, json.JSONDecodeError):
        return HubError(
            f"{endpoint} did not answer like a Hugging Face hub (no JSON from its API) for {what}; check HF_ENDPOINT"
        )
    if isinstance(exc, hfe.HFValidationError):
        return ModelNotFoundError(f"{repo_id!r} is not a valid Hugging Face repo id: {exc}")
    if isinstance(exc, OSError):
        return HubError(f"could not write {what} to the cache {hub_cache_dir()}: {exc}")
    return HubError(f"unexpected error while fetching {what} from {endpoint}: {type(exc).__name__}: {exc}")
