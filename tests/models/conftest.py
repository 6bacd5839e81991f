"""The ``llama_cpp`` marker: tests that compare with llama.cpp's llama-server
(tests/llama_cpp_server.py). They run when a binary is configured (``LLMCTL_TEST_LLAMA_SERVER``, or
the default build path exists) and fail when the variable names a missing file; without either,
they are deselected, and the run says why."""

from __future__ import annotations

from llama_cpp_server import DEFAULT_BINARY, ENV, configured_binary


def pytest_collection_modifyitems(config, items):
    if configured_binary() is not None:
        return
    deselected = [item for item in items if item.get_closest_marker("llama_cpp")]
    if not deselected:
        return
    items[:] = [item for item in items if not item.get_closest_marker("llama_cpp")]
    config.hook.pytest_deselected(items=deselected)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"deselected {len(deselected)} llama_cpp tests: no llama-server (set {ENV}, or build "
            f"{DEFAULT_BINARY} with ../shared/peer/build_llama_cpp.sh)"
        )
