"""Prompt templates: one problem (a string or a chat prompt) -> the prompt text the engine is given.

Invariant: `render_prompt` is the only place a prompt's text is made (the buffer, `eval` and `select-prompts` all
reach it through `pipeline.prompts.render_examples`), so a problem reads the same to every part of a run.

Chat templates: with template "auto" and a tokenizer that has a chat template, the prompt is that template applied
to the messages (a string problem becomes one user message: the problem plus INSTRUCTION; a chat prompt is used as
given, its own instructions included) with the generation prompt. `system_prompt` is then a system message put
first, unless the messages bring their own system message (which wins).
Other templates ("plain", "raw", "...{problem}...", or "auto" without a chat template) render one problem text:
a chat prompt must then be one user message, optionally after system messages; the system text (the row's own,
else `system_prompt`) goes before the rendered prompt, followed by a blank line.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from pipeline.data.rows import Message

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("auto", "plain", "raw")  # or a format string with a {problem} field


def validate_template(template: str) -> None:
    """Raise ValueError unless `template` is a named template or a format string whose only field is
    {problem}. Cheap, so configs can check it at load time."""
    if template in TEMPLATES:
        return
    if not isinstance(template, str) or "{problem}" not in template:
        raise ValueError(
            f"unknown prompt template {template!r}; use one of {TEMPLATES} or a format string containing "
            "{problem}, e.g. '{problem}='"
        )
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(
            f"prompt template {template!r} is not a valid format string ({e}); "
            "write literal braces as {{ and }}"
        ) from None
    if fields != {"problem"}:
        raise ValueError(
            f"prompt template {template!r} may only use the field {{problem}}, found "
            f"{sorted(fields - {'problem'})}; write literal braces as {{{{ and }}}}"
        )


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _one_turn(messages: Sequence[Message]) -> tuple[str, str]:
    """(system text, user text) of a chat prompt that a non-chat template can render; ValueError otherwise."""
    roles = [m["role"] for m in messages]
    first_turn = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
    if roles[first_turn:] != ["user"]:
        raise ValueError(
            f"a chat prompt with the roles {roles} needs a chat template: only one user message (after any system "
            "messages) can be rendered without one; use data.template = \"auto\" with a model whose tokenizer has a "
            "chat template"
        )
    system = "\n\n".join(m["content"] for m in messages[:first_turn] if m["content"].strip())
    return system, messages[first_turn]["content"].strip()


def _chat(messages: list[Message], tokenizer: Any, system_prompt: str) -> str:
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 -- jinja raises anything (e.g. "roles must alternate")
        raise ValueError(f"the tokenizer's chat template rejected the messages ({type(e).__name__}: {e}); fix the "
                         "row's messages, or data.system_prompt if the template takes no system role") from None


def render_prompt(problem: str | Sequence[Message], template: str, tokenizer: Any = None,
                  system_prompt: str = "") -> str:
    """The prompt text for one problem: a string, or a chat prompt (a sequence of {"role", "content"} messages).

    "auto": the tokenizer's chat template (see the module docstring) when the tokenizer has one; otherwise
    "plain". "plain": a plain-text prompt asking for the answer in \\boxed{}. "raw": the problem unchanged.
    Anything else must be a format string whose only field is {problem} (e.g. "{problem}="). Raises ValueError
    for a bad template, and for a chat prompt that the template cannot render.
    """
    validate_template(template)
    if template == "auto" and has_chat_template(tokenizer):
        if isinstance(problem, str):
            return _chat([{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}], tokenizer, system_prompt)
        return _chat(list(problem), tokenizer, system_prompt)
    if not isinstance(problem, str):
        own_system, problem = _one_turn(problem)
        system_prompt = own_system or system_prompt
    if template == "auto":
        template = "plain"
    if template == "plain":
        text = f"Problem: {problem}\n{INSTRUCTION}\nSolution:"
    elif template == "raw":
        text = problem
    else:
        text = template.format(problem=problem)
    return f"{system_prompt}\n\n{text}" if system_prompt else text
