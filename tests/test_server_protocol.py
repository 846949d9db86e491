"""The /ws frames, settings and CLI as plain data: no server, no kernel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernel_env.errors import (
    EpisodeFinished,
    KernelError,
    KernelStartError,
    LimitExceeded,
    ResetNeeded,
)
from kernel_env.models import CodeBlockResult, REPLObservation
from kernel_env.server.openenv.failures import error_for
from kernel_env.server.openenv.protocol import (
    Request,
    mcp_response,
    observation_frame,
    parse_frame,
)
from kernel_env.server.sessions import CapacityReached, SessionExpired
from kernel_env.server.settings import ServerSettings


def test_parse_frame_returns_requests_for_valid_frames() -> None:
    """Valid frames parse into requests; reset keeps its raw keywords (hf_token included)."""
    reset = parse_frame(json.dumps({"type": "reset", "data": {"context": "c", "hf_token": "t"}}))
    assert isinstance(reset, Request) and reset.reset == {"context": "c", "hf_token": "t"}
    step = parse_frame('{"type": "step", "data": {"code": "1"}}')
    assert isinstance(step, Request) and step.action is not None and step.action.code == "1"
    assert parse_frame('{"type": "state"}') == Request("state")
    assert parse_frame('{"type": "close"}') == Request("close")
    mcp = parse_frame('{"type": "mcp", "data": {"jsonrpc": "2.0"}}')
    assert isinstance(mcp, Request) and mcp.rpc == {"jsonrpc": "2.0"}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("", "INVALID_JSON"),
        (b"\x00\x01", "INVALID_JSON"),
        ("[" * 10_000, "INVALID_JSON"),
        ('{"type": "unknown"}', "UNKNOWN_TYPE"),
        ("{}", "UNKNOWN_TYPE"),
        ("[]", "VALIDATION_ERROR"),
        ('{"type": "state", "x": 1}', "VALIDATION_ERROR"),
        ('{"type": "step", "data": {"code": "1", "x": 1}}', "VALIDATION_ERROR"),
        ('{"type": "reset", "data": {"max_iterations": 0}}', "VALIDATION_ERROR"),
    ],
)
def test_parse_frame_answers_bad_frames_with_error_frames(raw: str | bytes, code: str) -> None:
    """A bad frame parses into the error frame that answers it."""
    frame = parse_frame(raw)
    assert isinstance(frame, dict) and frame["type"] == "error"
    assert frame["data"]["code"] == code


def test_unknown_type_message_is_bounded() -> None:
    """An absurdly long "type" is not echoed back in full."""
    frame = parse_frame(json.dumps({"type": "x" * 100_000}))
    assert isinstance(frame, dict) and len(frame["data"]["message"]) < 200


def test_observation_frame_puts_metadata_in_both_places() -> None:
    """reward and done sit at data; metadata at data.metadata and inside the observation."""
    obs = REPLObservation(
        result=CodeBlockResult(stdout="hi"), reward=0.5, done=True, metadata={"final_answer": "x"}
    )
    frame = observation_frame(obs, session_id="s")
    data = frame["data"]
    assert frame["type"] == "observation"
    assert data["reward"] == 0.5 and data["done"] is True
    assert data["metadata"] == {"final_answer": "x", "session_id": "s"}
    assert data["observation"]["metadata"] == data["metadata"]
    assert "reward" not in data["observation"] and "done" not in data["observation"]
    json.dumps(frame)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ResetNeeded("x"), "EXECUTION_ERROR"),
        (EpisodeFinished("over"), "EXECUTION_ERROR"),
        (KernelStartError("no kernel"), "FACTORY_ERROR"),
        (KernelError("gone"), "EXECUTION_ERROR"),
        (SessionExpired("session expired"), "SESSION_ERROR"),
        (LimitExceeded("code of 9 chars exceeds the limit of 1"), "VALIDATION_ERROR"),
        (ValueError("an internal bug, not the client's input"), "EXECUTION_ERROR"),
        (RuntimeError("boom"), "EXECUTION_ERROR"),
    ],
)
def test_error_for_maps_exceptions_to_codes(exc: Exception, code: str) -> None:
    """Each exception maps to its contract error code."""
    assert error_for(exc)["data"]["code"] == code


def test_step_before_reset_uses_openenv_text() -> None:
    """ResetNeeded answers OpenEnv's exact message."""
    message = error_for(ResetNeeded("whatever"))["data"]["message"]
    assert message == "Environment not initialized. Call reset() first."


def test_capacity_message_names_the_counts() -> None:
    """CapacityReached carries the counts the frame needs."""
    exc = CapacityReached(3, 3)
    assert (exc.active_sessions, exc.max_sessions) == (3, 3) and "3/3" in str(exc)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json", -32700),
        ({}, -32600),
        ([], -32600),
        ({"jsonrpc": "1.0", "method": "x"}, -32600),
        ({"jsonrpc": "2.0", "method": "tools/list", "id": 1}, -32603),
        ({"jsonrpc": "2.0", "method": "ping", "id": 1}, -32601),
    ],
)
def test_mcp_response_is_always_json_rpc(payload: object, code: int) -> None:
    """mcp_response answers every payload with a JSON-RPC 2.0 error object."""
    answer = mcp_response(payload)
    assert answer["jsonrpc"] == "2.0" and answer["error"]["code"] == code


# -- settings and CLI -------------------------------------------------------------------------


def test_settings_read_env_but_explicit_arguments_win() -> None:
    """KERNEL_ENV_* fill unset settings; an explicit argument always wins."""
    env = {
        "KERNEL_ENV_POOL_SIZE": "7",
        "KERNEL_ENV_STEP_TIMEOUT": "12.5",
        "KERNEL_ENV_TOKEN": "tok-7f3a",
        "KERNEL_ENV_PORT": "9000",
    }
    settings = ServerSettings.from_env(env, port=8123, pool_size=None)
    assert settings.port == 8123
    assert settings.pool_size == 7 and settings.step_timeout == 12.5
    assert settings.token == "tok-7f3a"
    assert "tok-7f3a" not in repr(settings)


def test_settings_reject_bad_values() -> None:
    """Unparseable variables and out-of-range values are errors, not silently ignored."""
    with pytest.raises(ValueError, match="KERNEL_ENV_POOL_SIZE"):
        ServerSettings.from_env({"KERNEL_ENV_POOL_SIZE": "many"})
    with pytest.raises(ValueError):
        ServerSettings(step_timeout=0)
    with pytest.raises(TypeError):
        ServerSettings.from_env({}, no_such_setting=1)


def test_backend_and_llm_settings_from_env() -> None:
    """Gateway, sandbox and LLM settings read KERNEL_ENV_*; an empty variable means unset;
    secrets stay out of repr."""
    env = {
        "KERNEL_ENV_GATEWAY_URL": "http://gw:8888",
        "KERNEL_ENV_GATEWAY_TOKEN": "gw-secret",
        "KERNEL_ENV_GATEWAY_KERNEL_NAME": "",
        "KERNEL_ENV_SANDBOX": "none",
        "KERNEL_ENV_LLM_BASE_URL": "http://llm/v1",
        "KERNEL_ENV_LLM_MODEL": "m",
        "KERNEL_ENV_LLM_API_KEY": "sk-secret",
        "KERNEL_ENV_LLM_MAX_CALLS": "50",
        "KERNEL_ENV_LLM_MAX_TOKENS": "",
    }
    settings = ServerSettings.from_env(env)
    assert (settings.gateway_url, settings.gateway_token) == ("http://gw:8888", "gw-secret")
    assert settings.gateway_kernel_name is None and settings.llm_max_tokens is None
    assert (settings.sandbox, settings.llm_model, settings.llm_max_calls) == ("none", "m", 50)
    assert "gw-secret" not in repr(settings) and "sk-secret" not in repr(settings)
    with pytest.raises(ValueError, match="sandbox"):
        ServerSettings(sandbox="chroot")
    with pytest.raises(ValueError, match="llm_model"):
        ServerSettings(llm_base_url="http://llm/v1")
    with pytest.raises(ValueError, match="KERNEL_ENV_LLM_MAX_CALLS"):
        ServerSettings.from_env({"KERNEL_ENV_LLM_MAX_CALLS": "lots"})


def test_default_step_timeout_is_below_the_client_wait() -> None:
    """The default step timeout leaves room under OpenEnv clients' 60 s reply wait."""
    assert ServerSettings().step_timeout <= 30


@pytest.mark.integration
def test_cli_serve_help_lists_the_flags() -> None:
    """`python -m kernel_env serve --help` documents the serve flags."""
    done = subprocess.run(
        [sys.executable, "-m", "kernel_env", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for flag in (
        "--host",
        "--port",
        "--pool-size",
        "--max-sessions",
        "--step-timeout",
        "--idle-ttl",
        "KERNEL_ENV_TOKEN",
    ):
        assert flag in done.stdout


def test_serve_flags_are_the_settings_and_name_their_defaults() -> None:
    """Every ServerSettings field but the secrets is a serve flag, whose help names its
    default, and a flag given reaches the setting of the same name."""
    import argparse
    import dataclasses

    from kernel_env.cli import _parser

    parser = _parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a for a in serve.choices["serve"]._actions if a.dest != "help"}
    secrets = {"token", "llm_api_key", "hf_router_url"}
    assert set(flags) == {f.name for f in dataclasses.fields(ServerSettings)} - secrets
    assert all("(default: " in (action.help or "") for action in flags.values())
    args = parser.parse_args(["serve", "--pool-size", "2", "--llm-allowed-models", "a, b"])
    assert (args.pool_size, args.llm_allowed_models, args.port) == (2, ("a", "b"), None)


@pytest.mark.integration
def test_cli_rejects_bad_settings_with_exit_2() -> None:
    """A bad flag value ends `serve` with exit code 2 and a message, before binding."""
    done = subprocess.run(
        [sys.executable, "-m", "kernel_env", "serve", "--step-timeout", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "step_timeout" in done.stderr
