"""The run configuration: OmegaConf structured dataclasses, one YAML per run.

Engine choice is a string (``rollout.engine=sim``); the engine's own options live under a
key named after it (``rollout.sim: {...}``) and are validated by the plugin's ``Options``.
This module is the schema only: it imports nothing else of Laminar's, so any part may read
it. Parsing is ``config.loader``; resolving engine names and options against the installed
plugins is ``runtime.resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunConfig:
    name: str = "laminar"
    seed: int = 0
    steps: int = 10  # trainer steps (weight versions) to run
    out_dir: str = "runs"
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end; -1: never
    resume: str = ""  # a run directory (or one of its checkpoints) to continue from
    checkpoint_on_stop: bool = True  # Ctrl-C / SIGTERM: save a checkpoint before stopping
    # stop with an error once every trajectory of this many consecutive steps failed (nothing
    # trains: e.g. every reward raises); 0: never
    max_failed_steps: int = 3
    # Held-out eval rounds (data.eval_*): after every eval_every steps and after the last;
    # 0: none; -1: only after the last step.
    eval_every: int = 0
    # Write every trained trajectory (ids, log-probs, reward, versions, finish reason) to
    # RUN_DIR/rollouts.jsonl, one line each, in training order: to inspect or replay what the
    # trainer learned from (verl's rollout_data_dir, slime's debug rollout dump).
    dump_rollouts: bool = False


@dataclass
class ModelConfig:
    path: str = ""  # a local Hugging Face model directory (real engines); see `laminar tiny-model`
    params_b: float = 7.0  # billions of parameters (sizes weight transfers, simulated engines)
    dtype: str = "bfloat16"


@dataclass
class DataConfig:
    prompts_per_step: int = 512  # GRPO groups per trainer step
    samples_per_prompt: int = 16
    source: str = "synthetic"
    size: int = 100_000  # synthetic dataset rows
    # Prompt lengths in tokens: real prompts longer than ``max_prompt_tokens`` are skipped
    # and counted; synthetic (simulator) prompts are drawn uniformly from [min, max].
    min_prompt_tokens: int = 128
    max_prompt_tokens: int = 2048
    shuffle: bool = True
    # Real prompts (laminar_core.tasks): source jsonl/parquet read ``path``; source task
    # generates rows with the registered task ``task`` called with ``task_options``.
    path: str = ""
    prompt_key: str = "prompt"  # the column/key holding the prompt text
    task: str = "repeat"
    task_options: dict[str, Any] = field(default_factory=dict)
    # The held-out eval set (run.eval_every; laminar_core.loop.evaluation), never trained
    # on: the first ``eval_size`` rows of ``eval_source`` ("": the training source drawn
    # with ``eval_seed`` -- None: the training seed + 1 -- a task built with task_options,
    # seed=eval_seed and ``eval_task_options``; jsonl/parquet: ``eval_path``) that are not
    # training prompts. Greedy at eval_temperature 0; sampled above it (request i seeded
    # with i every round); eval_max_tokens 0: rollout.max_tokens.
    eval_size: int = 32
    eval_source: str = ""
    eval_path: str = ""
    eval_seed: int | None = None
    eval_task_options: dict[str, Any] = field(default_factory=dict)
    eval_temperature: float = 0.0
    eval_max_tokens: int = 0


@dataclass
class RewardConfig:
    """How finished trajectories are scored (``laminar_core.tasks.build_reward``).

    ``fn``: a registered reward name (``laminar plugins`` lists them) or
    ``"package.module:function"``; empty means the task's own reward when
    ``data.source=task``, else no reward. ``options`` are passed to it as keyword arguments.
    A call that raises or runs past ``timeout_s`` marks its trajectory failed.
    """

    fn: str = ""
    timeout_s: float = 30.0
    workers: int = 4  # reward calls running at once (each in its own thread)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    """How many devices each role gets: what the run is, wherever it runs.

    A trainer rank is one GPU and a replica ``gpus_per_replica`` GPUs (its tensor-parallel
    size). On a machine without GPUs (``runtime.device: cpu``) each "GPU" is a process slot:
    ``trainer_gpus: 2`` is two trainer ranks.
    """

    gpus: int = 16
    gpus_per_node: int = 8
    trainer_gpus: int = 8  # trainer ranks; the rest run rollout replicas (disaggregated)
    gpus_per_replica: int = 1  # tensor-parallel size of one rollout replica
    colocate_sync: bool = True  # sync time-shares all GPUs between rollout and training (verl)


@dataclass
class RolloutConfig:
    engine: str = "sim"
    max_concurrent: int = 1024  # trajectories per replica the manager keeps in flight
    max_tokens: int = 16384
    temperature: float = 1.0
    top_p: float = 1.0
    partial_rollout: bool = False  # stale:K only: abort, update and resume (AReaL)
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    partial_sync_s: float = 5.0  # refresh the partial-response pool; 0 = only on abort
    # A failed replica is re-initialised in place (runtimes that host replicas apart from
    # the driver); after max_restarts failures within restart_window_s it is evicted.
    max_restarts: int = 3
    restart_window_s: float = 600.0


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA) instead of full fine-tuning; ``rank: 0`` (the default, or
    ``lora: {}``) trains every weight.

    Each linear layer whose name ends in one of ``target_modules`` (module names such as
    ``q_proj``, as PEFT matches them) gets ``W x + (alpha / rank) * B A dropout(x)`` with
    ``A: [rank, in]`` and ``B: [out, rank]`` (B starts at zero: version 0 is the base
    model); only A and B are trained, and a weight version is those tensors alone. The
    replicas load each version as an adapter (``docs/lora.md``).
    """

    rank: int = 0  # adapter rank; 0: full fine-tuning (no adapters)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, while training only
    # module-name suffixes of the linear layers that get adapters (PEFT's matching)
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )


@dataclass
class TrainerConfig:
    engine: str = "sim"
    mini_batches: int = 16
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # A dead rank (or a collective that timed out) restarts the trainer group from the
    # latest checkpoint while rollouts go on; more than max_restarts stops the run.
    max_restarts: int = 2


@dataclass
class RelayConfig:
    transport: str = "sim"
    chunks: int = 0  # 0: from the latency model (k*), or bucket_mb without a link model
    bucket_mb: float = 64.0
    # The latency model's link: seconds per byte and per-bucket start-up. Both > 0 override
    # everything; 0 takes the transport's own model, else a measurement at start-up
    # (calibrate), else bucket_mb.
    t_byte_s: float = 0.0
    t_start_s: float = 0.0
    calibrate: bool = True  # real transports: measure the trainer -> master link at open
    max_chunks: int = 4096  # upper bound on k*
    shm_dir: str = "/dev/shm/laminar"  # where relays share versions with their node's rollouts
    timeout_s: float = 600.0  # a broadcast (or repair) that takes longer is called off
    # No replica could receive a new version for this long (every relay dead and not coming
    # back): the run stops rather than training on ever older data. 0: never.
    max_unavailable_s: float = 300.0
    # Real weights: copy each version into host buffers and let the trainer resume at once
    # (its stall is that copy; the push to the master runs in the background). false: the
    # trainer waits until the master relay holds the version (no extra host copy).
    stage_push: bool = True
    # Relays on the nodes (nccl, rdma): the trainer's endpoint is in trainer rank 0's actor,
    # so versions go rank 0 -> master relay. false: rank 0 exports to the driver (through
    # Ray's object store) and the driver pushes (one more copy of the model per version).
    push_from_rank0: bool = True


@dataclass
class RepackConfig:
    policy: str = "best_fit"
    interval_s: float = 5.0
    kv_limit: float = 0.8  # C_max
    batch_limit: int = 64  # B, the roofline decode batch


@dataclass
class BufferConfig:
    sampler: str = "auto"  # auto: the schedule's own (fifo for laminar, by_batch otherwise)
    max_ahead_batches: float = 4.0  # laminar: outstanding groups <= this many steps' worth
    # A group older than this many versions when the trainer would take it is not trained
    # on (null: no bound): ``drop`` discards it and hands its prompt out again; ``wait``
    # keeps the trainer from running ahead of its rollouts by more than the bound.
    max_staleness: int | None = 8
    stale_policy: str = "drop"


@dataclass
class StudyConfig:
    """``laminar simulate``: which schedules to compare, and how (``sim.study``).

    ``repack_schedules``: the schedules (by name, e.g. ``laminar``, or full spec, e.g.
    ``stale:4+partial``) that run with ``repack.policy``; the others run without repack, as
    the systems they reproduce do. ``warmup_steps``: steps left out of every figure.
    """

    schedules: list[str] = field(default_factory=lambda: ["laminar", "sync", "one_step", "stale:2"])
    repack_schedules: list[str] = field(default_factory=lambda: ["laminar"])
    warmup_steps: int = 2
    sweep: list[dict[str, Any]] = field(default_factory=list)  # override sets, one per point


@dataclass
class RuntimeConfig:
    """Where the components run.

    ``local``: every component is a plain object in the driver (simulated engines, tests).
    ``ray``: trainer ranks and rollout replicas are Ray actors placed with a placement group;
    ``address`` empty starts a local cluster, ``auto`` or ``ray://host:port`` joins one.
    How many ranks and replicas, and the GPUs of each, is ``cluster.*``; what is here is how
    they are hosted: the device kind (``auto``: GPUs when the Ray cluster has any), the
    CPUs reserved per actor and, optionally, the cores each part may run on.
    """

    kind: str = "local"
    address: str = ""
    device: str = "auto"  # auto | cpu | cuda
    # Follow the Ray cluster: a node that joins gets a relay and replicas, one that leaves
    # is evicted. Fixed-size runs (false) are the default.
    elastic: bool = False
    num_cpus: int = 0  # local cluster only; 0: enough logical CPUs for every actor
    cpus_per_trainer: float = 1.0
    cpus_per_replica: float = 1.0
    placement_strategy: str = "PACK"
    start_timeout_s: float = 300.0  # per actor: loading a model, starting an engine
    # Cores (Linux CPU lists, "0-3,8") for the trainer ranks' and the replicas' processes, and
    # every thread and process they start, on each node; empty: the OS schedules them on any
    # core. Disjoint lists give the trainer and the rollout cores of their own, as separate
    # GPUs would: without them a CPU-only run time-shares every core between the two.
    trainer_cores: str = ""
    replica_cores: str = ""
    # Fork the trainer ranks' and the replicas' engine processes from a zygote on the
    # driver's node that imported their modules (torch, vLLM) once, instead of each actor
    # importing them again (start-up CPU on a small machine): auto (on for a CPU run's
    # actors on the driver's node; GPU actors and other nodes start as before), true, false.
    zygote: str = "auto"


@dataclass
class WandbConfig:
    """Weights & Biases: every metrics row logged per step, next to TensorBoard.

    Off while ``project`` is empty. ``mode``: ``online`` (needs ``wandb login``),
    ``offline`` (no network or account: files under ``RUN_DIR/wandb/``, upload later with
    ``wandb sync``) or ``disabled``. Needs the ``wandb`` package (``pip install wandb``).
    """

    project: str = ""
    entity: str = ""  # team or user; empty: the account's default
    mode: str = "online"
    name: str = ""  # empty: the run directory's name
    tags: list[str] = field(default_factory=list)


@dataclass
class TelemetryConfig:
    events: bool = True  # keep the event timeline (Chrome trace) in memory
    progress: bool = True  # console line per step
    tensorboard: bool = True  # RUN_DIR/tensorboard/ event files (needs the tensorboard package)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Where the engines' and Ray's own output goes: RUN_DIR/logs/<actor>.log ("run_dir"), or
    # the terminal ("terminal", what `laminar train --verbose` sets).
    engine_logs: str = "run_dir"


@dataclass
class TeacherConfig:
    """``algorithm.teacher``: the teacher of on-policy distillation (``algorithm.distill_coef``).

    ``model``: a local Hugging Face directory (empty: no teacher) whose tokenizer is the
    student's (``model.path``); ``engine``: the rollout engine that serves it (empty:
    ``rollout.engine``; it must implement ``RolloutEngine.score``; its options are its
    ``rollout.<engine>`` section); ``replicas``: teacher replicas, each hosted like a rollout
    replica (``cluster.gpus_per_replica``, ``runtime.cpus_per_replica``) beside the student's.
    """

    model: str = ""
    engine: str = ""
    replicas: int = 1


@dataclass
class AlgorithmConfig:
    """RL objective settings (the ``algorithm:`` section of the run config).

    Attributes:
        advantage: outcome-reward advantage estimator, one of ``ADVANTAGE_ESTIMATORS``.
        clip_low: PPO lower clip epsilon; the ratio is clipped at ``1 - clip_low``.
        clip_high: PPO upper clip epsilon ("clip-higher", DAPO); clipped at ``1 + clip_high``.
        off_policy: off-policy correction, one of ``OFF_POLICY_CORRECTIONS``.
        is_cap: cap ``rho`` on the per-token importance weight used by ``tis`` and
            ``decoupled``. ``None`` means uncapped, which only ``decoupled`` accepts.
        kl_coef: weight of the KL penalty to the reference policy; 0 disables it (and then
            no reference log-probs are needed).
        kl_estimator: per-token KL estimator, one of ``KL_ESTIMATORS``.
        loss_agg: how per-token losses are reduced, one of ``LOSS_AGGREGATIONS``.
        adv_eps: epsilon added to the std in the std-normalising estimators.
        loss: the policy loss, one of ``LOSSES``: ``ppo`` (clipped token ratio), ``gspo``
            (clipped sequence ratio; set clip_low/clip_high to ~3e-4/4e-4), ``cispo``
            (clipped stop-gradient IS weight times log-prob).
        is_level: how ``tis`` / ``decoupled`` form the IS weight, one of ``IS_LEVELS``:
            ``token``, ``sequence`` (product of the token ratios) or ``geometric`` (their
            geometric mean).
        is_mask: drop (zero the weight of) what leaves the ratio band ``[mask_low,
            mask_high]``, one of ``IS_MASKS``: ``none``, ``token`` (single tokens),
            ``sequence`` / ``geometric`` (whole sequences by their product / geometric-mean
            ratio). Needs ``off_policy`` ``tis`` or ``decoupled``.
        mask_low, mask_high: the band of ``is_mask``; must hold 1 (``0 <= mask_low < 1 <
            mask_high``).
        dynamic_sampling: DAPO's dynamic sampling: drop groups that carry no signal before
            they reach the experience buffer and hand their slots to new prompts. ``false``
            (off), ``true`` (drop zero-variance groups) or a mapping ``{filter, max_rate,
            patience}``: ``filter`` ``zero_variance`` or ``package.module:function``
            (``fn(rewards: list[float]) -> bool``, True: drop), the run stops once more than
            ``max_rate`` of a step's worth of groups were dropped ``patience`` times in a row
            (0: never).
        teacher: the teacher of on-policy distillation (``TeacherConfig``).
        distill_coef: weight of the per-token reverse KL to the teacher in each token's
            advantage (``algorithms.distill``); 0: off. Needs ``teacher.model``; without a
            reward (no ``reward.fn`` and no task reward) it is reward-free distillation.
    """

    advantage: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    off_policy: str = "none"
    is_cap: float | None = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token_mean"
    adv_eps: float = 1e-6
    loss: str = "ppo"
    is_level: str = "token"
    is_mask: str = "none"
    mask_low: float = 0.5
    mask_high: float = 2.0
    dynamic_sampling: Any = False
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill_coef: float = 0.0


@dataclass
class EnvConfig:
    """The ``env:`` section: the environment a multi-turn (tool-calling) rollout talks to.

    ``name`` (a plugin of kind ``env``; empty: no environment, single-turn rollouts),
    ``max_turns`` tool turns per trajectory, ``timeout_s`` per tool call (a timeout is an
    observation), the tool-call ``parser`` (kind ``parser``) and its ``parser_options``, and
    the environment's own ``options`` (validated by its ``Options``)."""

    name: str = ""
    max_turns: int = 8
    timeout_s: float = 30.0
    parser: str = "code"
    parser_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


VERSION_POLICIES = ("latest", "pin")
AGENT_FORKS = ("train", "last")


@dataclass
class AgentConfig:
    """The ``agent:`` section: agents that own their loop, served by the gateway
    (``docs/agents.md``). Set ``entrypoint`` or ``command`` and every rollout is an agent
    episode: a prompt's group is ``data.samples_per_prompt`` sessions, each running the
    agent once against the run's gateway (started in the driver with the run); every call
    goes through the rollout manager, and each closed session's samples are the trainer's
    trajectories, scored by the agent's reward (or ``reward.fn`` when it returns none).

    ``version_policy``: which weights a session's calls get. ``latest``: each call goes to
    a replica of the newest version it can get (a session may span versions; every token
    records its own); ``pin``: a session's calls all use the version of its first call
    (the replica serving it cannot load a newer version until the session ends).
    """

    # "package.module:function", an ``async def run(base_url, api_key, row) -> float | None``
    # run in the driver's event loop per episode (None: reward.fn scores the session)
    entrypoint: str = ""
    # a program run per episode as a subprocess (its own process group), with
    # OPENAI_BASE_URL, OPENAI_API_KEY, LAMINAR_ROW (the row as JSON) and LAMINAR_REWARD_FILE
    # set; e.g. [python, my_agent.py]
    command: list[str] = field(default_factory=list)
    # command: its reward is what it writes to $LAMINAR_REWARD_FILE, else the number after
    # the last stdout line starting with this prefix, else reward.fn's score of the session
    reward_prefix: str = "LAMINAR_REWARD="
    # command: run each episode's program inside laminar-sandbox (bubblewrap; root): its own
    # writable $HOME (the reward file's), the host's files hidden, the gateway its only
    # network, a uid and rlimits of its own (docs/agents.md)
    sandbox: bool = False
    # the sandbox's limits and view: memory_mb, cpu_s, processes, file_size_mb, disk_mb,
    # open_files, ro_paths (host paths it may read: the agent's code), env
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    model: str = "policy"  # the model name agents pass (GET /v1/models lists it)
    max_sessions: int = 64  # sessions (episodes) running at once; >= data.samples_per_prompt
    timeout_s: float = 300.0  # an episode's wall clock: past it the agent is stopped
    # runs of one episode: an agent that crashes, hangs past timeout_s or makes no call is
    # run again on the same row, up to this many times in all; then the sample is failed
    max_attempts: int = 2
    max_calls: int = 64  # model calls per session
    max_context_tokens: int = 4096  # one call's prompt + completion
    max_total_tokens: int = 32768  # all of a session's samples' tokens
    max_samples: int = 16  # samples per session (the first one and its forks)
    # a sample no call extends when the history is rewritten (a fork): "train" trains every
    # sample of the session with the episode's reward; "last" only the session's last one
    forks: str = "train"
    # a call asking for another temperature/top_p: "override" serves the run's and says so,
    # "reject" answers 400
    on_sampling_mismatch: str = "override"
    parser: str = "tool_call"  # the tool-call parser (plugin kind parser)
    parser_options: dict[str, Any] = field(default_factory=dict)
    # a call whose replica fails is generated again on another replica this many times,
    # then answered 503 with Retry-After
    call_retries: int = 2
    host: str = "127.0.0.1"  # where the gateway listens
    port: int = 0  # 0: a free port
    version_policy: str = "latest"


@dataclass
class LaminarConfig:
    run: RunConfig = field(default_factory=RunConfig)
    schedule: str = "laminar"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    repack: RepackConfig = field(default_factory=RepackConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    study: StudyConfig = field(default_factory=StudyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


# section -> (field naming the engine, plugin kind): extra keys there are engine options
ENGINE_SECTIONS = {
    "rollout": ("engine", "rollout"),
    "trainer": ("engine", "trainer"),
    "relay": ("transport", "transport"),
}

# Keys that were renamed or merged: the error for an old key names its replacement.
RENAMED = {
    "data.prompt_min_tokens": "data.min_prompt_tokens",
    "data.prompt_max_tokens": "data.max_prompt_tokens (one bound for real and synthetic prompts)",
    "runtime.gpus_per_trainer": (
        "cluster.trainer_gpus (a trainer rank is one GPU) and runtime.device (cpu|cuda|auto)"
    ),
    "runtime.gpus_per_replica": "cluster.gpus_per_replica and runtime.device (cpu|cuda|auto)",
}
