"""The soak's Locust users (loadtest/soak.py runs them headless): the mix of clients a served model meets.

Every request is written to `--soak-events` (JSON lines): a `begin` line when it is sent and an `end` line when
it ended, with its outcome (ok, cancelled by this client, refused before any work, failed), a short reason,
TTFT and inter-token gaps. A `begin` without an `end` is a hung request. Between the pauses in
`--soak-schedule` no user starts a request, so the server can drain and be measured idle.
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any other gRPC use, so the stream's reader cooperates with gevent

import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import gevent  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402
from inflight_client import InferenceError, LLMClient  # noqa: E402
from locust import User, between, constant, events, task  # noqa: E402

from loadtest import hostile_input  # noqa: E402

REQUEST_TIMEOUT_S = 120.0  # a request with no response for this long ends as "timeout", which counts as hung
_TEXT = (
    "river stone light paper garden window market winter silver engine forest signal harbor letter orange "
    "valley bridge candle music planet spring yellow bottle castle dragon island mirror pocket rocket shadow "
    "summer ticket velvet wonder anchor basket circle desert feather guitar hammer jungle kettle ladder meadow"
)
WORDS = _TEXT.split()
SYSTEM = "You are a concise assistant for a travel company. " + " ".join(WORDS * 3)  # shared: prefix-cache hits
SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 40}},
        "required": ["ok"],
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["items"],
    },
]
# Never sent in the soak: they kill processes (the soak's own faults do that on a schedule) or only wait.
HOSTILE_SKIPPED = ("baseline", "kill -9")

_ids = itertools.count()
_log = None
_control = ""  # the soak's control file: {"paused": bool, "end": epoch s}


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--soak-events", default="soak_events.jsonl", help="JSON lines: one per request begin/end")
    parser.add_argument("--soak-control", default="", help="JSON file: traffic paused or not, and its end")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000")
    parser.add_argument("--triton-http-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--long-prompt-words", type=int, default=900)
    parser.add_argument("--soak-seed", type=int, default=0)


@events.test_start.add_listener
def _open(environment, **_kwargs) -> None:
    global _log, _control
    opts = environment.parsed_options
    _log = open(opts.soak_events, "a", buffering=1)  # noqa: SIM115 - one line per write, for the whole test
    _control = opts.soak_control


@events.test_stop.add_listener
def _close(environment, **_kwargs) -> None:
    if _log is not None:
        _log.flush()


def _write(record: dict) -> None:
    _log.write(json.dumps(record, separators=(",", ":")) + "\n")


class Record:
    """One request's lines in the events file."""

    def __init__(self, kind: str) -> None:
        self.id, self.kind, self.t0 = next(_ids), kind, time.time()
        self.ttft: float | None = None
        self.gaps: list[float] = []
        _write({"ev": "begin", "id": self.id, "kind": kind, "t0": self.t0})

    def end(self, outcome: str, reason: str = "", tokens: int = 0) -> None:
        _write(
            {
                "ev": "end",
                "id": self.id,
                "kind": self.kind,
                "t0": self.t0,
                "t1": time.time(),
                "outcome": outcome,
                "reason": reason[:120],
                "tokens": tokens,
                "ttft": self.ttft,
                "itl": [round(g, 5) for g in self.gaps],
            }
        )


def wait_out_pause() -> bool:
    """Start nothing while the soak pauses the traffic; False once the traffic is over."""
    while _control:
        try:
            with open(_control) as f:
                state = json.load(f)
        except (OSError, ValueError):  # being replaced: read again
            gevent.sleep(0.1)
            continue
        if time.time() >= state["end"]:
            gevent.sleep(3600)  # idle until Locust stops (it stops a waiting user at once)
            return False
        if not state["paused"]:
            return True
        gevent.sleep(0.5)
    return True


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def grpc_reason(e: InferenceError) -> tuple[str, str]:
    """(outcome, reason) of a gRPC error: refused (before any work) or failed."""
    text = e.message
    if "DEADLINE_EXCEEDED" in (e.code or "") or "no response within" in text:
        return "failed", "timeout"
    if "engine process died" in text:
        return "failed", "engine died"
    if e.kind == "unavailable" or "unavailable" in text.lower() or "not ready" in text:
        return "refused", "unavailable"
    return "failed", f"grpc: {text[:80]}"


def openai_reason(e: Exception) -> tuple[str, str]:
    if isinstance(e, openai.APITimeoutError):
        return "failed", "timeout"
    if isinstance(e, openai.APIConnectionError):
        return "refused", "connection"
    if isinstance(e, openai.APIStatusError):
        outcome = "refused" if e.status_code in (429, 503) else "failed"
        return outcome, f"http {e.status_code}"
    if isinstance(e, openai.APIError):  # an error event inside a stream
        message = str(getattr(e, "message", e))
        return "failed", "engine died" if "engine process died" in message else f"stream error: {message[:60]}"
    if isinstance(e, OSError):
        return "failed", f"transport: {type(e).__name__}"
    return "failed", f"{type(e).__name__}: {str(e)[:60]}"


class SoakUser(User):
    abstract = True
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.rng = random.Random(f"{opts.soak_seed}-{type(self).__name__}-{id(self)}")
        self.grpc = LLMClient(self.host, timeout_s=REQUEST_TIMEOUT_S)
        self.api = openai.OpenAI(
            base_url=f"{opts.openai_url}/v1",
            api_key=opts.api_key or "none",
            max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        )

    def grpc_stream(self, kind: str, prompt: str, params: dict, cancel_after: int | None = None) -> None:
        rec = Record(kind)
        last = None
        try:
            with self.grpc.stream(prompt, params) as stream:
                for n, delta in enumerate(stream, 1):
                    now = time.time()
                    if last is None:
                        rec.ttft = now - rec.t0
                    else:
                        rec.gaps.append((now - last) / max(1, delta.num_tokens))
                    last = now
                    if cancel_after is not None and n >= cancel_after:
                        stream.cancel()
                        rec.end("cancelled", "client cancel", n)
                        return
            done = stream.completion
        except InferenceError as e:
            outcome, reason = grpc_reason(e)
            if reason == "engine died" and rec.ttft is None:  # turned away while the core restarts
                outcome = "refused"
            rec.end(outcome, reason)
            return
        if done is None or done.finish_reason not in ("length", "stop"):
            rec.end("failed", f"finish {None if done is None else done.finish_reason}")
        else:
            rec.end("ok", done.finish_reason, done.num_output_tokens)

    def chat(self, kind: str, messages: list, stream: bool, close_after: int | None = None, **extra) -> None:
        rec = Record(kind)
        try:
            if not stream:
                reply = self.api.chat.completions.create(model="llm", messages=messages, **extra)
                choice = reply.choices[0]
                problem = self.check(choice.message.content or "", choice.finish_reason, extra)
                usage = reply.usage.completion_tokens if reply.usage else 0
                rec.end("failed", problem) if problem else rec.end("ok", choice.finish_reason or "", usage)
                return
            finish, chunks, last = None, 0, None
            with self.api.chat.completions.create(model="llm", messages=messages, stream=True, **extra) as events_:
                for chunk in events_:
                    if not chunk.choices:
                        continue
                    now = time.time()
                    if chunk.choices[0].delta.content:
                        chunks += 1
                        if last is None:
                            rec.ttft = now - rec.t0
                        else:
                            rec.gaps.append(now - last)
                        last = now
                    finish = chunk.choices[0].finish_reason or finish
                    if close_after is not None and chunks >= close_after:
                        break  # leaving the block closes the connection: the client went away
            if close_after is not None and finish is None:
                rec.end("cancelled", "client disconnect", chunks)
            elif finish in ("stop", "length"):
                rec.end("ok", finish, chunks)
            else:
                rec.end("failed", f"finish {finish}")
        except Exception as e:  # every way a call can end is recorded; none is raised into Locust
            outcome, reason = openai_reason(e)
            rec.end("failed" if outcome == "refused" and rec.ttft is not None else outcome, reason)  # mid-stream

    def check(self, text: str, finish: str | None, extra: dict) -> str:
        """'' when a non-streamed answer is what was asked for, else what is wrong."""
        if finish not in ("stop", "length"):
            return f"finish {finish}"
        schema = extra.get("response_format", {}).get("json_schema", {}).get("schema")
        if schema is None or finish != "stop":
            return ""
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"output breaks its schema: {str(e)[:50]}"
        return ""


class GrpcStreamUser(SoakUser):
    """Triton's gRPC stream, greedy: half ask to repeat a text (n-gram drafts hit), half share a long prefix."""

    fixed_count = 2

    @task
    def generate(self) -> None:
        if not wait_out_pause():
            return
        text = words(self.rng, self.rng.randint(20, 60))
        prompt = f"Repeat exactly: {text}\nRepeated: {text[:40]}" if self.rng.random() < 0.5 else f"{SYSTEM}\n{text}"
        self.grpc_stream("grpc", prompt, {"max_tokens": self.rng.randint(16, 96), "temperature": 0})


class ChatStreamUser(SoakUser):
    fixed_count = 2

    @task
    def chat_stream(self) -> None:
        if not wait_out_pause():
            return
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Plan a trip: {words(self.rng, 12)}"},
        ]
        temperature = self.rng.choice([0.0, 0.7])
        self.chat("chat_stream", messages, True, max_tokens=self.rng.randint(16, 96), temperature=temperature)


class ChatUser(SoakUser):
    """Non-streamed chat completions; one in three constrained by a JSON schema (some unseen before: the grammar
    cache grows and must stay within its bound)."""

    fixed_count = 2

    @task
    def chat(self) -> None:
        if not wait_out_pause():
            return
        messages = [{"role": "user", "content": f"Describe {words(self.rng, 6)} as JSON."}]
        if self.rng.random() < 1 / 3:
            super().chat("chat", messages, False, max_tokens=self.rng.randint(8, 48), temperature=0)
            return
        schema = self.rng.choice(SCHEMAS)
        if self.rng.random() < 0.5:  # a schema the cache has not seen
            salt = self.rng.randrange(10**9)
            schema = dict(schema, properties=dict(schema["properties"], **{f"x{salt}": {"type": "integer"}}))
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        super().chat("structured", messages, False, max_tokens=96, temperature=0, response_format=fmt)


class LongPromptUser(SoakUser):
    """Prompts near max_model_len: with the soak's small KV cache, running ones get preempted."""

    fixed_count = 1

    @task
    def long_prompt(self) -> None:
        if not wait_out_pause():
            return
        n = self.environment.parsed_options.long_prompt_words
        prompt = f"{SYSTEM}\n{words(self.rng, self.rng.randint(n * 3 // 4, n))}\nSummary:"
        params = {"max_tokens": self.rng.randint(48, 128), "ignore_eos": True, "temperature": 0}
        self.grpc_stream("long", prompt, params)


class CancelUser(SoakUser):
    """Goes away mid-stream: a gRPC cancel, or an OpenAI stream's connection closed."""

    fixed_count = 1

    @task
    def go_away(self) -> None:
        if not wait_out_pause():
            return
        after = self.rng.randint(2, 8)
        if self.rng.random() < 0.5:
            params = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.8}
            self.grpc_stream("cancel", words(self.rng, 30), params, cancel_after=after)
        else:
            messages = [{"role": "user", "content": f"Tell a long story about {words(self.rng, 5)}"}]
            self.chat("cancel", messages, True, close_after=after, max_tokens=200, extra_body={"ignore_eos": True})


class HostileUser(SoakUser):
    """A trickle of loadtest/hostile_input.py's cases, one at a time, cycling."""

    fixed_count = 1
    wait_time = constant(20.0)

    def on_start(self) -> None:
        super().on_start()
        opts = self.environment.parsed_options
        ctx = {
            "client": self.grpc,
            "api": opts.openai_url,
            "http": opts.triton_http_url,
            "launcher": None,
            "api_headers": {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None,
        }
        limits = SimpleNamespace(max_stop_strings=64, max_stop_str_len=1024)  # EngineConfig's defaults
        found = hostile_input.attacks(ctx, limits)
        self.attacks = itertools.cycle([a for a in found if not a.name.startswith(HOSTILE_SKIPPED)])

    @task
    def attack(self) -> None:
        if not wait_out_pause():
            return
        attack = next(self.attacks)
        rec = Record("hostile")
        try:
            got = attack.fn()
        except Exception as e:  # the driver's own failure
            rec.end("failed", f"{attack.name}: {e!r}")
            return
        text = got if isinstance(got, str) else repr(got)
        rec.end(hostile_outcome(got), f"{attack.name}: {text}")


def hostile_outcome(got) -> str:
    """A clear answer (served, or refused with a 4xx or an error that names the limit) is the success here;
    503 and 429 are refusals; a closed connection, another 5xx or an internal error are failures."""
    statuses = [got[0]] if isinstance(got, tuple) else got if isinstance(got, list) else []
    if any(s is None or (s >= 500 and s != 503) for s in statuses):
        return "failed"
    if any(s in (429, 503) for s in statuses):
        return "refused"
    if isinstance(got, str) and ("internal" in got.lower() or "NOT served" in got or "driver error" in got):
        return "failed"
    return "ok"
