"""Value checks that need only the schema: ranges, known kinds, consistency across sections.

``check_values`` runs after the types were checked (OmegaConf) and before engine names are
resolved against the plugins (``runtime.resolve``). Each failure is a one-line
``ConfigError`` naming the key.
"""

from __future__ import annotations

import difflib
import re

from laminar_core.config.loader import ConfigError, close_match
from laminar_core.config.schema import AGENT_FORKS, VERSION_POLICIES, LaminarConfig

# synthetic: lengths only (simulator); jsonl/parquet: data.path; task: a registered generator
DATA_SOURCES = ("synthetic", "jsonl", "parquet", "task")


def check_values(cfg: LaminarConfig) -> None:
    """Every schema-level check (see module docstring)."""
    _positive(cfg)
    _buffer(cfg)
    _telemetry(cfg)
    _data_reward(cfg)
    _runtime(cfg)
    _agent(cfg)
    _lora(cfg)
    import torch  # only here: parsing a config must not pay for torch

    if not isinstance(getattr(torch, cfg.model.dtype, None), torch.dtype):
        raise ConfigError(
            f"model.dtype: '{cfg.model.dtype}' is not a torch dtype; e.g. bfloat16, float16, "
            f"float32{close_match(cfg.model.dtype, ('bfloat16', 'float16', 'float32'))}"
        )


def _agent(cfg: LaminarConfig) -> None:
    a = cfg.agent
    policy = a.version_policy
    if policy not in VERSION_POLICIES:
        raise ConfigError(
            f"agent.version_policy: unknown '{policy}'; known: {', '.join(VERSION_POLICIES)}"
            f"{close_match(policy, VERSION_POLICIES)}"
        )
    if a.forks not in AGENT_FORKS:
        raise ConfigError(
            f"agent.forks: unknown '{a.forks}'; known: {', '.join(AGENT_FORKS)}"
            f"{close_match(a.forks, AGENT_FORKS)}"
        )
    if a.on_sampling_mismatch not in ("override", "reject"):
        raise ConfigError(
            f"agent.on_sampling_mismatch: unknown '{a.on_sampling_mismatch}'; known: "
            "override, reject"
        )
    if a.entrypoint and a.command:
        raise ConfigError(
            "agent.entrypoint and agent.command are both set: an episode runs one agent; "
            "keep one of them"
        )
    if a.entrypoint and not _ENTRYPOINT.match(a.entrypoint):
        raise ConfigError(
            f"agent.entrypoint: '{a.entrypoint}' is not 'package.module:function' "
            "(an async def run(base_url, api_key, row) -> float | None)"
        )
    if a.command and not all(isinstance(x, str) and x for x in a.command):
        raise ConfigError("agent.command must be a list of non-empty strings, e.g. [python, a.py]")
    if a.sandbox and not a.command:
        raise ConfigError(
            "agent.sandbox runs agent.command programs only (an entrypoint runs in the "
            "driver's event loop); set agent.command, or agent.sandbox=false"
        )
    for key, value, low in [
        ("agent.max_sessions", a.max_sessions, 1),
        ("agent.max_attempts", a.max_attempts, 1),
        ("agent.max_calls", a.max_calls, 1),
        ("agent.max_context_tokens", a.max_context_tokens, 2),
        ("agent.max_total_tokens", a.max_total_tokens, 2),
        ("agent.max_samples", a.max_samples, 1),
        ("agent.call_retries", a.call_retries, 0),
        ("agent.port", a.port, 0),
    ]:
        if value < low:
            raise ConfigError(f"{key} must be >= {low} (got {value})")
    if not a.timeout_s > 0:
        raise ConfigError(f"agent.timeout_s must be > 0 (got {a.timeout_s})")
    if not (a.entrypoint or a.command):
        return
    if cfg.env.name:
        raise ConfigError(
            f"agent.{'entrypoint' if a.entrypoint else 'command'} and env.name are both set: "
            "an agent drives its own loop (its tools are its own); drop env.name"
        )
    if a.max_sessions < cfg.data.samples_per_prompt:
        raise ConfigError(
            f"agent.max_sessions ({a.max_sessions}) < data.samples_per_prompt "
            f"({cfg.data.samples_per_prompt}): a prompt's group is that many sessions at once; "
            "raise agent.max_sessions"
        )
    if cfg.rollout.engine == "sim":
        raise ConfigError(
            "agent.* needs a real rollout engine (the gateway serves text; simulated replicas "
            "produce none): set rollout.engine to vllm or sglang"
        )


_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _lora(cfg: LaminarConfig) -> None:
    lora = cfg.trainer.lora
    if lora.rank < 0:
        raise ConfigError(f"trainer.lora.rank must be >= 0 (0: full fine-tuning), got {lora.rank}")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"trainer.lora.alpha must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"trainer.lora.dropout must be in [0, 1), got {lora.dropout}")
    names = list(lora.target_modules)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            "trainer.lora.target_modules must name at least one linear layer (e.g. [q_proj, "
            f"v_proj]), got {names}"
        )
    heads = [n for n in names if n.split(".")[-1] in ("lm_head", "embed_tokens")]
    if heads:
        raise ConfigError(
            f"trainer.lora.target_modules: {heads} are not decoder linear layers; adapters go "
            "on attention and MLP projections (q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj)"
        )


def _positive(cfg: LaminarConfig) -> None:
    rules = [
        ("run.steps", cfg.run.steps, 0),
        ("data.prompts_per_step", cfg.data.prompts_per_step, 1),
        ("data.samples_per_prompt", cfg.data.samples_per_prompt, 1),
        ("data.size", cfg.data.size, 1),
        ("data.min_prompt_tokens", cfg.data.min_prompt_tokens, 1),
        ("data.max_prompt_tokens", cfg.data.max_prompt_tokens, 1),
        ("cluster.gpus", cfg.cluster.gpus, 1),
        ("cluster.gpus_per_node", cfg.cluster.gpus_per_node, 1),
        ("cluster.gpus_per_replica", cfg.cluster.gpus_per_replica, 1),
        ("cluster.trainer_gpus", cfg.cluster.trainer_gpus, 1),
        ("rollout.max_tokens", cfg.rollout.max_tokens, 1),
        ("trainer.mini_batches", cfg.trainer.mini_batches, 1),
        ("repack.batch_limit", cfg.repack.batch_limit, 1),
        ("study.warmup_steps", cfg.study.warmup_steps, 0),
        ("rollout.max_restarts", cfg.rollout.max_restarts, 0),
        ("trainer.max_restarts", cfg.trainer.max_restarts, 0),
        ("run.max_failed_steps", cfg.run.max_failed_steps, 0),
    ]
    value: float
    for key, value, low in rules:
        if value < low:
            raise ConfigError(f"{key} must be >= {low} (got {value})")
    for key, value in [
        ("rollout.heartbeat_s", cfg.rollout.heartbeat_s),
        ("rollout.heartbeat_timeout_s", cfg.rollout.heartbeat_timeout_s),
        ("model.params_b", cfg.model.params_b),
        ("buffer.max_ahead_batches", cfg.buffer.max_ahead_batches),
        ("rollout.restart_window_s", cfg.rollout.restart_window_s),
    ]:
        if not value > 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    for key, value in [
        ("repack.interval_s", cfg.repack.interval_s),
        ("rollout.partial_sync_s", cfg.rollout.partial_sync_s),
        ("relay.chunks", cfg.relay.chunks),
        ("relay.bucket_mb", cfg.relay.bucket_mb),
        ("relay.max_unavailable_s", cfg.relay.max_unavailable_s),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (got {value})")
    if cfg.data.source == "synthetic" and cfg.data.max_prompt_tokens < cfg.data.min_prompt_tokens:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) must be >= "
            f"data.min_prompt_tokens ({cfg.data.min_prompt_tokens})"
        )
    if not 0 < cfg.repack.kv_limit <= 1:
        raise ConfigError(f"repack.kv_limit must be in (0, 1] (got {cfg.repack.kv_limit})")
    if cfg.rollout.max_concurrent < cfg.data.samples_per_prompt:
        raise ConfigError(
            f"rollout.max_concurrent ({cfg.rollout.max_concurrent}) must be >= "
            f"data.samples_per_prompt ({cfg.data.samples_per_prompt}): a group "
            "is placed on one replica"
        )
    c = cfg.cluster
    if c.trainer_gpus >= c.gpus:
        raise ConfigError(
            f"cluster.trainer_gpus ({c.trainer_gpus}) must be < cluster.gpus "
            f"({c.gpus}): the rest run rollout replicas"
        )
    if (c.gpus - c.trainer_gpus) < c.gpus_per_replica:
        raise ConfigError(
            f"cluster: {c.gpus - c.trainer_gpus} rollout GPUs cannot hold one "
            f"replica of cluster.gpus_per_replica={c.gpus_per_replica}"
        )


RUNTIME_KINDS = ("local", "ray")
DEVICES = ("auto", "cpu", "cuda")
ZYGOTE_MODES = ("auto", "true", "false")


def _runtime(cfg: LaminarConfig) -> None:
    rt = cfg.runtime
    if rt.kind not in RUNTIME_KINDS:
        hint = difflib.get_close_matches(rt.kind, RUNTIME_KINDS, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(
            f"runtime.kind: unknown '{rt.kind}'{extra}; known: {', '.join(RUNTIME_KINDS)}"
        )
    if rt.device not in DEVICES:
        raise ConfigError(
            f"runtime.device: unknown '{rt.device}'{close_match(rt.device, DEVICES)}; "
            f"known: {', '.join(DEVICES)}"
        )
    if str(rt.zygote).lower() not in ZYGOTE_MODES:
        raise ConfigError(
            f"runtime.zygote: unknown '{rt.zygote}'; known: {', '.join(ZYGOTE_MODES)}"
        )
    rt.zygote = str(rt.zygote).lower()
    for key, value in [
        ("runtime.cpus_per_trainer", rt.cpus_per_trainer),
        ("runtime.cpus_per_replica", rt.cpus_per_replica),
        ("runtime.num_cpus", rt.num_cpus),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (got {value})")
    if not rt.start_timeout_s > 0:
        raise ConfigError(f"runtime.start_timeout_s must be > 0 (got {rt.start_timeout_s})")
    for key, text in [
        ("runtime.trainer_cores", rt.trainer_cores),
        ("runtime.replica_cores", rt.replica_cores),
    ]:
        if not text:
            continue
        if rt.kind != "ray":
            raise ConfigError(
                f"{key} places actors on cores: it needs runtime.kind: ray (got "
                f"'{rt.kind}', where everything runs in the driver's process)"
            )
        try:
            parse_cores(text)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None


def parse_cores(text: str) -> frozenset[int]:
    """The cores of a Linux CPU list (``"0-3,8"``, as ``taskset -c`` takes it).

    Raises ``ValueError`` naming the bad part.
    """
    cores: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (hi.isdigit() if sep else not hi)):
            raise ValueError(
                f"'{part}' in '{text}' is not a core or a range of cores: write a CPU list "
                "such as '0', '0-3' or '0,2,4-7'"
            )
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"'{part}' in '{text}': the range runs backwards")
        cores.update(range(first, last + 1))
    return frozenset(cores)


STALE_POLICIES = ("drop", "wait")


ENGINE_LOGS = ("run_dir", "terminal")


def _telemetry(cfg: LaminarConfig) -> None:
    where = cfg.telemetry.engine_logs
    if where not in ENGINE_LOGS:
        raise ConfigError(
            f"telemetry.engine_logs: unknown '{where}'{close_match(where, ENGINE_LOGS)}; "
            f"known: {', '.join(ENGINE_LOGS)}"
        )


def _buffer(cfg: LaminarConfig) -> None:
    b = cfg.buffer
    if b.max_staleness is not None and b.max_staleness < 0:
        raise ConfigError(
            f"buffer.max_staleness must be >= 0, or null for no bound (got {b.max_staleness})"
        )
    if b.stale_policy not in STALE_POLICIES:
        raise ConfigError(
            f"buffer.stale_policy: unknown '{b.stale_policy}'"
            f"{close_match(b.stale_policy, STALE_POLICIES)}; known: {', '.join(STALE_POLICIES)}"
        )


def _data_reward(cfg: LaminarConfig) -> None:
    """``data.*`` / ``reward.*`` that need no plugin: the source and its own settings.
    Files are not opened here (a cluster reads them where the run starts)."""
    d, r = cfg.data, cfg.reward
    if d.source not in DATA_SOURCES:
        raise ConfigError(
            f"data.source: unknown '{d.source}'; known: {', '.join(DATA_SOURCES)}"
            f"{close_match(d.source, DATA_SOURCES)}"
        )
    if not d.prompt_key:
        raise ConfigError("data.prompt_key must name the prompt column (e.g. prompt)")
    if d.source in ("jsonl", "parquet") and not d.path:
        raise ConfigError(
            f"data.source={d.source} needs a file: set data.path=/path/to/data.{d.source}"
        )
    _eval(cfg)
    if not r.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s must be > 0 (got {r.timeout_s})")
    if r.workers < 1:
        raise ConfigError(f"reward.workers must be >= 1 (got {r.workers})")


def _eval(cfg: LaminarConfig) -> None:
    """``run.eval_every`` and ``data.eval_*`` (the held-out eval rounds)."""
    d = cfg.data
    if cfg.run.eval_every < -1:
        raise ConfigError(
            f"run.eval_every must be >= -1 (got {cfg.run.eval_every}): N > 0 evaluates after "
            "every N steps and the last, -1 after the last only, 0 never"
        )
    for key, value, low in [
        ("data.eval_size", d.eval_size, 1),
        ("data.eval_max_tokens", d.eval_max_tokens, 0),
    ]:
        if value < low:
            raise ConfigError(f"{key} must be >= {low} (got {value})")
    if d.eval_temperature < 0:
        raise ConfigError(
            f"data.eval_temperature must be >= 0 (got {d.eval_temperature}; 0 is greedy)"
        )
    if d.eval_source and d.eval_source not in DATA_SOURCES:
        raise ConfigError(
            f"data.eval_source: unknown '{d.eval_source}'; known: {', '.join(DATA_SOURCES)} "
            f"(empty: data.source){close_match(d.eval_source, DATA_SOURCES)}"
        )
    if d.eval_source in ("jsonl", "parquet") and not d.eval_path:
        raise ConfigError(
            f"data.eval_source={d.eval_source} needs a file of held-out prompts: set "
            f"data.eval_path=/path/to/eval.{d.eval_source}"
        )
