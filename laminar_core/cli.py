"""The ``laminar`` command: train, simulate, report, export, config show, plugins.

Every expected failure (bad config, bad data file, unknown engine) ends with one line on
stderr that names the problem, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_core import ConfigError, load_config
from laminar_core.plugins import PluginResolveError, UnknownPluginError, default_manager
from laminar_core.runtime.resolve import schedule_of
from laminar_core.runtime.train import TrainError
from laminar_core.sim.lengths import LengthFileError

if TYPE_CHECKING:
    from laminar_core.sim.study import StudyTrace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in [
        ("train", "run the loop with the configured engines"),
        ("simulate", "run the configured schedules on a virtual clock"),
    ]:
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", help="run config (YAML)")
        s.add_argument("overrides", nargs="*", help="key=value overrides")
        if name == "train":
            s.add_argument(
                "--verbose",
                action="store_true",
                help="engine and Ray output on the terminal (default: RUN_DIR/logs/)",
            )
        if name == "simulate":
            s.add_argument(
                "--out", help="write the result rows as JSON here (default: a new run directory)"
            )
            s.add_argument("--schedules", help="comma-separated, replaces study.schedules")
            s.add_argument(
                "--trace",
                metavar="FILE",
                help="write one run's Perfetto/Chrome timeline to FILE, and its events, "
                "metrics and config next to it (for `laminar report DIR`)",
            )
            s.add_argument(
                "--trace-schedule",
                metavar="NAME",
                help="the schedule to trace (default: the first; with a sweep, the first point)",
            )
    c = sub.add_parser("config", help="config utilities")
    csub = c.add_subparsers(dest="config_cmd", required=True)
    show = csub.add_parser("show", help="print the resolved config")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    ref = csub.add_parser(
        "reference", help="every config key with its type, default and meaning (docs/config.md)"
    )
    ref.add_argument("--out", help="write it here (default: stdout)")
    sub.add_parser("plugins", help="list every discovered engine, transport, policy, schedule")
    rep = sub.add_parser(
        "report", help="plots and an index.html from a run directory (or a simulate --trace dir)"
    )
    rep.add_argument("run_dir", help="a run directory, or the directory of a simulate --trace")
    rep.add_argument("--out", help="where to write (default: RUN_DIR/report/)")
    tiny = sub.add_parser(
        "tiny-model", help="write a tiny random-init Qwen2-style model + char tokenizer (no hub)"
    )
    tiny.add_argument("out_dir", help="directory to write (Hugging Face format)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--preset",
        default="tiny",
        help="sizes: tiny (0.3M parameters, the quickstart) or small (3.2M, the long-tail "
        "workload); the size flags below override the preset's",
    )
    tiny.add_argument("--hidden-size", type=int, default=None)
    tiny.add_argument("--layers", type=int, default=None)
    tiny.add_argument(
        "--heads", type=int, default=None, help="head dim = hidden / heads (64 or 32)"
    )
    tiny.add_argument("--kv-heads", type=int, default=None)
    tiny.add_argument("--intermediate-size", type=int, default=None)
    tiny.add_argument(
        "--warmup",
        metavar="TASK",
        help="then fit it to TASK's synthetic demonstrations (tool_calling: the tool-call "
        "format, seconds to a minute of CPU) so RL starts from a model that knows the format",
    )
    tiny.add_argument("--warmup-steps", type=int, default=600)
    tiny.add_argument(
        "--warmup-share",
        type=float,
        default=0.5,
        help="tool_calling: share of demonstrations that call the tool and copy its output "
        "(the rest guess); fewer than half and the tiny model learns no copying in 600 steps",
    )
    exp = sub.add_parser(
        "export",
        help="a run's checkpoint as a PEFT adapter directory (LoRA) or a Hugging Face model",
    )
    exp.add_argument("run_dir", help="a run directory (its latest checkpoint) or a checkpoint")
    exp.add_argument(
        "--merge", action="store_true", help="LoRA: fold the adapter into the base model"
    )
    exp.add_argument("--out", help="where to write (default: RUN_DIR/export/step_N[-merged])")
    return p


def _export(args: argparse.Namespace) -> int:
    from laminar_core.runtime.export import export_checkpoint

    try:
        out = export_checkpoint(args.run_dir, args.out, merge=args.merge)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {out}")
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    from laminar_core.models import build_tiny_model
    from laminar_core.models.warmup import WARMUPS, warm_start

    if args.warmup is not None and args.warmup not in WARMUPS:
        known = ", ".join(sorted(WARMUPS))
        print(
            f"laminar: error: tiny-model: unknown --warmup {args.warmup!r}; known: {known}",
            file=sys.stderr,
        )
        return 2
    try:
        out = build_tiny_model(
            args.out_dir,
            seed=args.seed,
            preset=args.preset,
            hidden_size=args.hidden_size,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
        )
        if args.warmup is not None:
            import torch

            torch.set_num_threads(1)  # small batches: more threads only contend
            report = warm_start(
                out,
                args.warmup,
                steps=args.warmup_steps,
                share=args.warmup_share,
                seed=args.seed,
                log=print,
            )
            print(report.summary())
    except (ValueError, ImportError) as e:
        print(f"laminar: error: tiny-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (use it with model.path={out})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from laminar_core.telemetry.report import ReportError, write_report

    try:
        rep = write_report(args.run_dir, args.out)
    except ReportError as e:
        print(f"laminar: error: report: {e}", file=sys.stderr)
        return 2
    for note in rep.notes:
        print(f"laminar report: note: {note}", file=sys.stderr)
    names = ", ".join(p.name for p in rep.images) or "no plots"
    print(f"wrote {rep.index} ({names}) in {rep.seconds:.1f} s")
    return 0


def _study_trace(args: argparse.Namespace, specs: list[str]) -> StudyTrace | None:
    """The ``StudyTrace`` of ``--trace``/``--trace-schedule``, checked before anything runs."""
    from laminar_core.sim.study import StudyTrace, check_trace_path

    if not args.trace:
        if args.trace_schedule:
            raise ConfigError("--trace-schedule needs --trace FILE")
        return None
    if args.trace_schedule and args.trace_schedule not in specs:
        raise ConfigError(
            f"--trace-schedule: '{args.trace_schedule}' is not one of this study's schedules: "
            f"{', '.join(specs)}"
        )
    try:
        path = check_trace_path(args.trace)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return StudyTrace(path, args.trace_schedule or "")


def _simulate(args: argparse.Namespace) -> int:
    from laminar_core.sim.study import format_table, run_study, write_json

    resolved = load_config(args.config, args.overrides)
    schedules = None
    if args.schedules:
        schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
        for spec in schedules:
            schedule_of(resolved, spec)  # validate before running anything
    trace = _study_trace(args, schedules or list(resolved.cfg.study.schedules))

    def progress(row: dict) -> None:
        where = f"[{row['point']}] " if row["point"] else ""
        print(
            f"  {where}{row['schedule']}: {row['throughput_tokens_per_s']:,.0f} tokens/s "
            f"({row['wall_seconds']:.1f} s wall)",
            file=sys.stderr,
            flush=True,
        )

    rows = run_study(resolved, schedules=schedules, progress=progress, trace=trace)
    print(format_table(rows))
    if trace is not None and trace.written:
        print(f"wrote {trace.path} and, next to it, {', '.join(p.name for p in trace.written[1:])}")
        print(f"  (render it with: laminar report {trace.path.parent})")
    elif trace is not None:  # a sweep point replaced study.schedules: the schedule never ran
        print(
            f"laminar: warning: --trace: schedule '{trace.schedule}' never ran; nothing traced",
            file=sys.stderr,
        )
    if args.out:
        out = Path(args.out)
    else:
        from laminar_core.runtime.train import make_run_dir

        out = make_run_dir(resolved) / "simulate.json"
    write_json(rows, out)
    print(f"wrote {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from laminar_core.runtime.train import train

    overrides = [*args.overrides, *(["telemetry.engine_logs=terminal"] if args.verbose else [])]
    resolved = load_config(args.config, overrides)
    # prints the run directory first, so a crash still names it
    run_dir = train(resolved, own_process=True)
    print(f"done: {run_dir}")
    return 0


def _console_logging() -> None:
    """Laminar's own warnings (a replica restarted, a relay replaced, ...) on the terminal,
    one line each; the libraries' chatter at ERROR."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("laminar: %(message)s"))
    root = logging.getLogger("laminar_core")
    if not root.handlers:
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
        root.propagate = False
    for noisy in ("ray", "vllm", "transformers", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def config_reference() -> str:
    """``docs/config.md``: core's sections, then each installed plugin's own options."""
    from laminar_core.config import reference
    from laminar_core.config.schema import ENGINE_SECTIONS, LaminarConfig

    hints = typing.get_type_hints(LaminarConfig)
    sections = [
        ("run-level keys", _TopLevel, "", "Keys at the top of the config file."),
        *(
            (f"`{f.name}`", hints[f.name], f.name, "")
            for f in dataclasses.fields(LaminarConfig)
            if dataclasses.is_dataclass(hints[f.name])
        ),
    ]
    pm = default_manager()
    where = {kind: f"{sec}.NAME" for sec, (_, kind) in ENGINE_SECTIONS.items()}
    where.update(env="env.options", task="data.task_options")
    for kind, prefix in where.items():
        for name in pm.names(kind):
            options = getattr(pm.get(kind, name), "Options", None)
            if options is None or not dataclasses.is_dataclass(options):
                continue
            path = prefix.replace("NAME", name)
            sections.append((f"`{path}` ({kind} `{name}`)", options, path, ""))
    return reference.render(sections)


@dataclasses.dataclass
class _TopLevel:
    """Keys at the top of the config file."""

    # the schedule: sync | one_step | stale:K[+partial] | laminar (docs/schedules.md)
    schedule: str = "laminar"


def _config_reference(args: argparse.Namespace) -> int:
    text = config_reference()
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "train" and not getattr(args, "verbose", False):
        _console_logging()
    try:
        if args.cmd == "plugins":
            print(default_manager().format_table())
            return 0
        if args.cmd == "config" and args.config_cmd == "reference":
            return _config_reference(args)
        if args.cmd == "config":
            print(load_config(args.config, args.overrides).to_yaml(), end="")
            return 0
        if args.cmd == "simulate":
            return _simulate(args)
        if args.cmd == "train":
            return _train(args)
        if args.cmd == "tiny-model":
            return _tiny_model(args)
        if args.cmd == "report":
            return _report(args)
        if args.cmd == "export":
            return _export(args)
    except (ConfigError, LengthFileError, UnknownPluginError, PluginResolveError, TrainError) as e:
        print(f"laminar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("laminar: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
