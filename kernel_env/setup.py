"""An episode's setup in its kernel: the context (inline, or staged as a file), the seed, the
output caps, and how they get there.

A language whose kernel takes its setup from a request (:attr:`Language.setup_key`: Python's,
kernel_env's extension) gets it in the metadata of the episode's next request, and its state
names the setup's token once applied: a cell of its own would cost each reset a round trip to
the kernel and its CPU. Any other language gets a setup cell (its shim, then its setup call),
run at once. The pending setup is plain data (a dict, or None once applied) that the episode
holds.
"""

from __future__ import annotations

import uuid
from typing import Any

from kernel_env.config import EnvConfig
from kernel_env.errors import KernelError
from kernel_env.kernel import Kernel
from kernel_env.languages import catalog as languages
from kernel_env.record import EpisodeRecord
from kernel_env.text import shorten

__all__ = ["check", "prepare"]

_CONTEXT_FILE = ".kernel_env_context.txt"


async def prepare(
    config: EnvConfig, record: EpisodeRecord, kernel: Kernel, language: languages.Language
) -> dict[str, Any] | None:
    """Set the episode up in ``kernel``: the setup its next request carries, or None (the
    language's setup cell has run)."""
    if language.setup_key is None:
        await _set_up_by_cell(record, kernel, language)
        return None
    params: dict[str, Any] = {
        "token": uuid.uuid4().hex,
        "seed": record.seed,
        "output_cap": config.kernel_output_cap,
        "display_count": config.display_count,
        "display_chars": config.display_chars,
        "max_prompt_chars": config.max_prompt_chars,
    }
    if kernel.quiet_iopub:
        params["quiet"] = True
    if len(record.context) <= config.inline_context_chars:
        params["context"] = record.context
    else:
        data = record.context.encode("utf-8")
        try:
            params["context_path"] = await kernel.stage_file(_CONTEXT_FILE, data)
        except OSError as exc:  # the kernel put something in the way (a dir, a symlink)
            raise KernelError(
                f"episode setup failed: the context could not be staged ({exc.strerror})",
                kernel_id=kernel.kernel_id,
                episode_id=record.episode_id,
            ) from None
    return params


async def _set_up_by_cell(
    record: EpisodeRecord, kernel: Kernel, language: languages.Language
) -> None:
    """Another language's episode: its shim, context and task prompt, as a setup cell."""
    why = await languages.set_up(kernel, language, record.context, record.task_prompt)
    if why is None and record.language_info is None:
        record.language_info = await kernel.language_info()
    if why is not None:
        raise KernelError(
            f"episode setup failed in the {language.kernel_name!r} kernel: {shorten(why, 500)}",
            kernel_id=kernel.kernel_id,
            episode_id=record.episode_id,
        )


async def check(
    pending: dict[str, Any] | None,
    state: dict[str, Any],
    record: EpisodeRecord,
    kernel: Kernel,
    language: languages.Language,
) -> dict[str, Any] | None:
    """The setup still pending once the kernel reported ``state``: None once the state names
    its token; else :class:`KernelError`, why not.

    A kernel whose state names no token and no error does not take a setup from a request
    (an older kernel_env's extension, in a gateway's kernel image): it gets the setup as a
    cell of its own. With no state to tell (a cell broke the state's helper), the setup stays
    pending: the next request carries it again, and the kernel applies a token once."""
    if pending is None or state.get("setup") == pending["token"]:
        return None
    why = state.get("setup_error") or state.get("error")
    if why is None and "names" not in state:
        return pending
    if why is None:
        why = await _as_a_cell(pending, kernel, language)
        if why is None:
            return None
    raise KernelError(
        f"episode setup failed in the kernel: {shorten(str(why), 500)}",
        kernel_id=kernel.kernel_id,
        episode_id=record.episode_id,
    )


async def _as_a_cell(
    pending: dict[str, Any], kernel: Kernel, language: languages.Language
) -> str | None:
    """Run the pending setup as a silent cell; None, or why it failed."""
    code = language.setup_fallback_code(pending)
    if code is None:
        return "the kernel did not apply the setup its request carried"
    result = await kernel.execute(code, silent=True, timeout=15.0)
    return None if result.success else result.stderr.strip()[-500:] or result.status
