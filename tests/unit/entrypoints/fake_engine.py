"""Fakes of the server's engine client, for the in-process server tests: `FakeEngine`, an
object shaped like `AsyncLLM` (generate, input_processor, tokenizer, max_model_len, errored,
...) that answers with scripted outputs, so the wire format is checked in seconds with no
model.

The fake's tokenizer maps each character to its code point. Completion `j` of a request says
`engine.replies[j]` (default `REPLIES`), one character per token, cut at `max_tokens`
("length") or at a stop string ("stop", stop_reason the string). A prompt containing "FAIL"
ends with finish_reason "error"; one containing "DIE" raises EngineDeadError after its first
output. With `logprobs`, each token has itself (-0.5) and "?" (-2.0) as alternatives.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from types import SimpleNamespace
from typing import Any

from pagedinfer.engine.core_client import EngineDeadError
from pagedinfer.outputs import CompletionOutput, Logprob, RequestOutput
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams
from pagedinfer.tokenizer import NO_CHAT_TEMPLATE

REPLIES = ["red green", "blue sky", "gold"]


class FakeTokenizer:
    """One token per character, its id the code point."""

    max_token_chars = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{chr(i)}>" for i in ids]

    chat_template: str | None = "role: content"
    """The model's own template (None: a base model without one)."""

    renders_tools = True
    """False: the template ignores `tools` (as SmolLM2's does)."""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        content_as_text: bool = False,
        **variables: Any,
    ) -> str | list[int]:
        """`role: content` lines; a `chat_template` given is written first, in brackets, and
        `tools` first of all, as `tools: NAME,NAME` (a line); other variables (a request's
        `chat_template_kwargs`) follow it as `NAME=VALUE` lines. A message's `tool_calls`
        are written after its content as `-> NAME(ARGUMENTS as JSON)`."""
        if chat_template is None and self.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        text = ""
        if tools is not None and self.renders_tools:
            text += f"tools: {','.join(t['function']['name'] for t in tools)}\n"
        text += f"[{chat_template}]" if chat_template is not None else ""
        text += "".join(f"{k}={v}\n" for k, v in sorted(variables.items()))
        for m in messages:
            calls = "".join(
                f" -> {c['function']['name']}({json.dumps(c['function']['arguments'])})"
                for c in m.get("tool_calls", [])
            )
            text += f"{m['role']}: {m['content']}{calls}\n"
        text += "assistant: " if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


class FakeInputProcessor:
    vocab_size = 1000

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def process(self, request_id: str, prompt: Any, params: SamplingParams, *args: Any) -> Any:
        ids = prompt.get("prompt_token_ids") or [ord(ch) for ch in prompt.get("prompt", "")]
        if len(ids) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError(f"The prompt is {len(ids)} tokens, too long.")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError("Token id out of vocabulary.")
        return SimpleNamespace(prompt_token_ids=ids), prompt.get("prompt")


class FakeEngine:
    """Scripted `AsyncLLM`: records every request's params and what was aborted."""

    def __init__(self, max_model_len: int = 256) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.input_processor = FakeInputProcessor(max_model_len)
        self.stat_loggers: list[Any] = []
        self.dead = False
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.salts: dict[str, str | None] = {}
        """Each request's prompt `cache_salt` (None without)."""
        self.aborted: list[str] = []
        self.num_cached_tokens = 0
        self.replies = list(REPLIES)

    @property
    def errored(self) -> bool:
        return self.dead

    async def get_scheduler_stats(self) -> dict[str, float]:
        return {"num_running_reqs": 1, "num_waiting_reqs": 2, "kv_cache_usage": 0.25}

    def shutdown(self) -> None:
        pass

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.dead:
            raise EngineDeadError("Engine core is dead.\nTraceback: hidden")
        _, text = self.input_processor.process(request_id, prompt, params)
        ids = prompt.get("prompt_token_ids") or [ord(ch) for ch in text]
        self.params[request_id] = params
        self.prompts[request_id] = ids
        self.salts[request_id] = prompt.get("cache_salt")
        said = "".join(chr(i) for i in ids)
        replies = [self._reply(j, said, params) for j in range(params.n)]
        finished = False
        try:
            if params.output_kind == RequestOutputKind.FINAL_ONLY:
                finished = True
                yield self._output(request_id, text, ids, params, replies, None, True)
                return
            for step in range(max(len(r[0]) for r in replies)):
                if step == 1 and "DIE" in said:
                    raise EngineDeadError("Engine core died.\nTraceback: hidden")
                finished = step == max(len(r[0]) for r in replies) - 1
                yield self._output(request_id, text, ids, params, replies, step, finished)
        finally:
            if not finished:
                self.aborted.append(request_id)

    def _reply(self, j: int, prompt: str, params: SamplingParams) -> tuple[str, str, str | None]:
        """(text, finish_reason, stop_reason) of completion `j`."""
        if "FAIL" in prompt:
            return "x", "error", "grammar failed to compile"
        text, finish, stop_reason = self.replies[j % len(self.replies)], "stop", None
        for stop in params.stop or []:
            if stop in text:
                text, stop_reason = text[: text.index(stop)], stop
        if params.max_tokens is not None and len(text) > params.max_tokens:
            text, finish = text[: params.max_tokens], "length"
        return text, finish, stop_reason

    def _output(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        replies: list[tuple[str, str, str | None]],
        step: int | None,
        finished: bool,
    ) -> RequestOutput:
        """All of each reply (`step` None) or its character `step` (DELTA)."""
        outputs = []
        for j, (text, finish, stop_reason) in enumerate(replies):
            piece = text if step is None else text[step : step + 1]
            if step is not None and step >= len(text):
                continue
            done = step is None or step == len(text) - 1
            ids = [ord(ch) for ch in piece]
            logprobs = None
            if params.logprobs is not None:
                logprobs = [
                    {t: Logprob(-0.5, 1, chr(t)), ord("?"): Logprob(-2.0, 2, "?")} for t in ids
                ]
            outputs.append(
                CompletionOutput(
                    index=j,
                    text=piece,
                    token_ids=ids,
                    cumulative_logprob=None,
                    logprobs=logprobs,
                    finish_reason=finish if done else None,
                    stop_reason=stop_reason if done else None,
                )
            )
        extra = params.extra_args or {}
        kv = {"remote_block_ids": [1]} if finished and "kv_transfer_params" in extra else None
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=kv,
        )


def openai_client(engine: FakeEngine, **flags: Any) -> Iterator[Any]:
    """The official `openai` client over `build_app(engine, **flags)` in process (one item:
    use as `for client in openai_client(engine): ...`, the app's lifespan around it)."""
    import openai
    from fastapi.testclient import TestClient

    from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app

    with TestClient(build_app(engine, DEFAULT_MODEL_NAME, **flags)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
