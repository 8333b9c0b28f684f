"""`gr2`: the user-facing command.

    gr2 run [--stage S] [--force] [-v] run the pipeline flow (Prefect) over the DVC stages; one console line per stage start/end
    gr2 stages                        the stages in DVC's order, and which are out of date
    gr2 status [--no-dvc]             per stage: metrics written and when, headline metrics, out of date or not
    gr2 report                        reports/index.html: tables and figures from the metrics and MLflow, offline
    gr2 workspace DEST --profile P    a self-contained copy of the project with a params profile
    gr2 data download                 fetch the public raw Amazon review files
    gr2 promote MODEL [--version N]   move `champion` to a version through the gates in params.yaml
    gr2 bench decode                  AR GR2 vs diffusion and speculative decoding: speed -> metrics/speed.json
    gr2 bench serve [MODEL@ALIAS]     bounded load test of the served champion on loopback (latency, no 5xx)
    gr2 schedule serve                scheduled retraining: a local Prefect server + the gr2-retrain deployment
    gr2 schedule run                  one retraining now (refresh data, rerun what changed, push, promote)
    gr2 data snapshot                 version a new snapshot of schedule.source as prepare.data_dir (DVC)
    gr2 reproduce MODEL@ALIAS         rebuild a registered version from its commit and data hash, compare
    gr2 serve MODEL@ALIAS             MLflow's scoring server for a version, with its request-body cap (413)
    gr2 results [--out docs/results.md] docs/results.md and the README's results table, from a workspace's metrics
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# Quiet, offline-friendly defaults for every tool the pipeline drives
# (shared/notes/STACK.md); a user's own settings win.
ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
}


def _where_to_look(root: Path) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    return "\n".join(
        [
            "Where to look:",
            f"  MLflow UI:    mlflow ui --backend-store-uri {uri}   (then http://127.0.0.1:5000)",
            "  Prefect UI:   prefect server start                  (then http://127.0.0.1:4200; flow 'gr2-pipeline')",
            f"  DVC metrics:  cd {root} && dvc metrics show",
        ]
    )


def _project_root(args: argparse.Namespace, needs: str, hint: str) -> Path | None:
    """`--root` resolved, or None (after saying so on stderr) when it lacks `needs`."""
    root = Path(args.root).resolve()
    if not (root / needs).exists():
        print(f"error: {root}/{needs} not found; {hint}", file=sys.stderr)
        return None
    return root


def cmd_run(args: argparse.Namespace) -> int:
    from flows.console import setup_run_logging
    from flows.pipeline import check_params, pipeline
    from flows.prefect_api import temporary_api
    from tasks.common import ParamsError
    from tasks.tracking import configure

    root = _project_root(args, "dvc.yaml", "run from the project root or pass --root")
    if root is None:
        return 2
    try:
        check_params(root)  # every stage's params before the first stage starts; nothing is written yet
    except ParamsError as exc:
        print(f"error: {exc}\nnothing was run; fix {root / 'params.yaml'} and run again", file=sys.stderr)
        return 2
    configure(root)
    if args.launch is not None:
        from tasks.common import LAUNCH_ENV

        # The stages read it (tasks.common.stage_main); dvc.yaml's commands stay as they are.
        os.environ[LAUNCH_ENV] = args.launch
    run_log = setup_run_logging(root, verbose=args.verbose)
    print(f"gr2 run in {root}; full log: {run_log.path}" + ("" if args.verbose else " (-v shows it here)"), flush=True)
    try:
        with temporary_api(root):
            summaries = pipeline(root=str(root), stages=args.stage or None, force=args.force)
    except (RuntimeError, ValueError, ParamsError) as exc:
        # A failed stage's message ends with its last lines of output (flows/dvc_stages.repro).
        print(f"\npipeline failed: {exc}\n\nfull log: {run_log.path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the running stage was stopped and its MLflow run marked KILLED. Stages that "
            "finished are kept, and a stage with saved states resumes from the last one: run `gr2 run` "
            f"again to go on.\n\nfull log: {run_log.path}",
            file=sys.stderr,
        )
        return 130
    finally:
        run_log.close()
    for s in summaries:
        if reg := s.get("registered"):
            print(f"{s['stage']}: registered {reg['model']} version {reg['version']} ({'new' if reg['created'] else 'existing'})")
    report = root / "reports" / "index.html"
    print("\n" + _where_to_look(root) + (f"\n  Report:       file://{report}" if report.exists() else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Per stage: metrics written and when, headline metrics, and whether DVC would rerun it."""
    from flows.console import status_rows, status_table
    from flows.dvc_stages import changed_stages, stage_order

    root = _project_root(args, "dvc.yaml", "run from the project root or pass --root")
    if root is None:
        return 2
    changed = None if args.no_dvc else changed_stages(root)
    print(status_table(status_rows(root, stage_order(root), changed)))
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    from flows.dvc_stages import changed_stages, stage_order

    root = Path(args.root).resolve()
    changed = changed_stages(root)
    for name in stage_order(root):
        print(f"{name:<12} {'changed' if name in changed else 'up to date'}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Draw reports/index.html from the metrics on disk (and MLflow's curves and registry unless --no-mlflow)."""
    from tasks.report import load_inputs, write_report
    from tasks.tracking import configure

    root = _project_root(args, "metrics", "run the pipeline first (`gr2 run`) or pass --root")
    if root is None:
        return 2
    if not args.no_mlflow:
        configure(root)
    path = write_report(load_inputs(root, with_mlflow=not args.no_mlflow, with_registry=not args.no_mlflow))
    print(f"written: {path}\n  open file://{path}")
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    """Write docs/results.md from the workspace's metrics and rewrite the README's results block. Exit 2: bad input."""
    from tasks.results import ResultsError, write_results

    try:
        written = write_results(Path(args.root), Path(args.out), None if args.no_readme else Path(args.readme), args.label)
    except ResultsError as exc:
        print(f"results: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"written: {path}")
    return 0


def cmd_workspace(args: argparse.Namespace) -> int:
    from flows.workspace import make_workspace

    dest = make_workspace(
        Path(args.root), Path(args.dest), args.profile, Path(args.data_dir) if args.data_dir else None, snapshot=args.snapshot, remote=args.remote
    )
    print(f"workspace ready: {dest}\n  cd {dest} && gr2 run")
    return 0


def cmd_data_download(args: argparse.Namespace) -> int:
    from gr2model.data.dataset import download_raw

    dest = Path(args.dest)
    download_raw(args.category, dest)
    print(f"downloaded to {dest}. Point the pipeline at it: set `prepare.data_dir: {dest}` in params.yaml")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Exit 0: promoted (or already champion); 1: refused by a gate; 2: nothing to judge; 3: lost a race."""
    from flows.prefect_api import temporary_api
    from flows.promote import Decision, PromotionBusy, PromotionConflict, PromotionError, promote, promote_flow
    from tasks.tracking import configure

    root = Path(args.root).resolve()
    configure(root)
    try:
        if args.no_flow:
            decision = promote(args.model, args.version, root).to_dict()
        else:
            with temporary_api(root):
                decision = promote_flow(args.model, args.version, str(root))
    except (PromotionConflict, PromotionBusy) as exc:
        print(f"promotion not committed: {exc}", file=sys.stderr)
        return 3
    except PromotionError as exc:
        print(f"promotion failed: {exc}", file=sys.stderr)
        return 2
    d = Decision.from_dict(decision)
    print(d.summary())
    if d.gates:
        print("\n" + d.table())
    return 0 if d.status in ("promoted", "already-champion") else 1


def cmd_bench_decode(args: argparse.Namespace) -> int:
    """The decode-speed benchmark of `evaluate` on its own (needs checkpoints/gr2 and the diffusion checkpoints)."""
    from gr2model.eval.bench import speed_table
    from tasks.common import load_stage_config
    from tasks.evaluate import CONFIG, GR2, SPEED, STAGE, run_bench

    root = Path(args.root).resolve()
    cfg = load_stage_config(STAGE, CONFIG, root / "params.yaml")
    overrides = {k: v for k, v in (
        ("taus", args.tau), ("batch_sizes", args.batch_size), ("examples", args.examples),
        ("spec_draft_mode", args.draft_mode), ("spec_draft_len", args.draft_len), ("repeats", args.repeats),
    ) if v}  # fmt: skip
    if args.sub_block_cache:
        overrides["sub_block_cache_sizes"] = args.sub_block_cache
        overrides["sub_block_sizes"] = sorted(set(cfg.bench.sub_block_sizes) | set(args.sub_block_cache), reverse=True)
    cfg = cfg.model_copy(update={"bench": cfg.bench.model_copy(update=overrides)})
    if not (root / GR2).exists():
        print(f"{root / GR2}: no GR2 checkpoint; run `gr2 run --stage cft` first", file=sys.stderr)
        return 2
    rows = run_bench(cfg, root, logging.getLogger("gr2.bench"))
    print(speed_table(rows))
    print(f"\nwritten: {root / SPEED}")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Exit 0: the load test passed; 1: it found failures; 2: nothing to serve."""
    import mlflow
    from mlflow import MlflowClient

    from flows.bench_serve import bench_serve, report_dict
    from tasks.common import write_json_atomic
    from tasks.traces import load_lists
    from tasks.tracking import configure

    root = Path(args.root).resolve()
    configure(root)
    model = args.model
    if model is None:  # the champion re-ranker: diffusion first, as the pipeline's end product
        client = MlflowClient()
        for name in ("diffusion-gr2", "gr2"):
            try:
                client.get_model_version_by_alias(name, "champion")
            except mlflow.exceptions.MlflowException:
                continue
            model = f"{name}@champion"
            break
        else:
            print("bench serve: no diffusion-gr2@champion or gr2@champion; pass MODEL@ALIAS or promote one (`gr2 promote`)", file=sys.stderr)
            return 2
    uri = model if model.startswith("models:/") else f"models:/{model}"
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
        lists = load_lists(root, "test").head(args.rows)
    except (mlflow.exceptions.MlflowException, OSError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    keys = ["history", "candidates"] + (["evidence"] if "evidence" in lists.columns else [])
    rows = lists.select(keys).to_dicts()
    print(f"load test of {uri}: {args.requests} requests, {args.concurrency} at a time, {args.bad_share:.0%} malformed or oversized", flush=True)
    report = bench_serve(
        local, rows, requests=args.requests, concurrency=args.concurrency, bad_share=args.bad_share,
        max_new_tokens=args.max_new_tokens, seed=args.seed, log_path=root / ".gr2" / "bench-serve.log",
    )  # fmt: skip
    print(report.text())
    if args.out:
        write_json_atomic({"model": uri, **report_dict(report)}, Path(args.out))
        print(f"written: {args.out}")
    return 0 if report.passed else 1


def cmd_serve_check(args: argparse.Namespace) -> int:
    """Exit 0: every served ranking equals the evaluate row's; 1: some differ; 2: the check cannot be made."""
    from flows.serve_check import ServeCheckError, serve_check
    from tasks.tracking import configure

    root = Path(args.root).resolve()
    configure(root)
    try:
        report = serve_check(root, args.model, split=args.split, examples=args.examples, batch=args.batch, log_path=root / ".gr2" / "serve-check.log")
    except (ServeCheckError, RuntimeError) as exc:
        print(f"serve-check: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    return 0 if report.passed else 1


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Exit 0: reproduced; 1: not reproduced or not reproducible; 2: nothing to reproduce."""
    from flows.reproduce import ReproduceError, reproduce

    try:
        report = reproduce(args.model, args.version, Path(args.root), remote=args.remote, rtol=args.rtol, keep=args.keep, record=not args.no_record)
    except ReproduceError as exc:
        print(f"reproduce: {exc}", file=sys.stderr)
        return 2
    print("\n" + report.text())
    return 0 if report.reproduced else 1


def cmd_schedule_serve(args: argparse.Namespace) -> int:
    from flows.schedule import load_schedule_config, serve

    root = Path(args.root).resolve()
    cfg = load_schedule_config(root)
    when = f"every {args.interval:g} s" if args.interval else f"cron '{args.cron or cfg.cron}' ({cfg.timezone})"

    def ready(api: str, server_pid: int | None) -> None:
        started = f"started a Prefect server (pid {server_pid})" if server_pid else "using the Prefect server"
        print(f"{started} at {api}; UI {api.removesuffix('/api')}", flush=True)
        print(f"serving gr2-retrain/{args.name} for {root}, {when}; Ctrl-C stops it{' and the server' if server_pid else ''}", flush=True)

    try:
        serve(root, interval_s=args.interval, cron=args.cron, name=args.name, host=args.host, port=args.port, start_api=not args.no_server, on_ready=ready)
    except RuntimeError as exc:
        print(f"schedule serve: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_schedule_run(args: argparse.Namespace) -> int:
    from flows.prefect_api import temporary_api
    from flows.schedule import retrain
    from tasks.tracking import configure

    root = Path(args.root).resolve()
    configure(root)
    with temporary_api(root):
        result = retrain(root=str(root))
    snap = result["snapshot"]
    if snap.get("md5"):
        print(f"data snapshot {snap['path']}: {snap['md5']} ({'new content' if snap['changed'] else 'unchanged'})")
    print("stages: " + ", ".join(f"{k} {v}" for k, v in result["stages"].items()))
    for r in result["registered"]:
        print(f"registered {r['model']} version {r['version']} ({'new' if r['created'] else 'existing'})")
    for p in result["promotions"]:
        print(p["summary"])
    return 0


def cmd_data_snapshot(args: argparse.Namespace) -> int:
    from flows.schedule import load_schedule_config
    from flows.snapshot import SnapshotError, snapshot_data

    root = Path(args.root).resolve()
    cfg = load_schedule_config(root)
    source = args.source or cfg.source
    if not source:
        print("data snapshot: no source: pass --source or set schedule.source in params.yaml", file=sys.stderr)
        return 2
    try:
        result = snapshot_data(root, Path(source), commit=cfg.commit and not args.no_commit, push=cfg.push)
    except SnapshotError as exc:
        print(f"data snapshot: {exc}", file=sys.stderr)
        return 2
    print(
        f"snapshot {result['path']}: {result['md5']} ({'new content' if result['changed'] else 'unchanged'})"
        + (f", committed {result['commit'][:12]}" if result["commit"] else "")
        + (", pushed" if result["pushed"] else "")
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Replace this process by uvicorn running flows.serving_app: `gr2 serve`'s pid is the server's."""
    import mlflow

    from flows.serving_app import MODEL_PATH_ENV
    from tasks.tracking import configure

    configure(Path(args.root).resolve())
    if Path(args.model, "MLmodel").exists():  # a model folder on disk
        uri = str(Path(args.model).resolve())
    else:
        uri = args.model if "://" in args.model or args.model.startswith("models:/") else f"models:/{args.model}"
    try:
        local = uri if Path(uri).is_dir() else mlflow.artifacts.download_artifacts(artifact_uri=uri)
    except mlflow.exceptions.MlflowException as exc:
        print(f"serve: {uri}: {exc.message}", file=sys.stderr)
        return 2
    env = {**os.environ, MODEL_PATH_ENV: local}
    argv = [sys.executable, "-m", "uvicorn", "--factory", "flows.serving_app:create_app", "--host", args.host, "--port", str(args.port)]
    print(f"serving {uri} at http://{args.host}:{args.port}/invocations (pid {os.getpid()})", flush=True)
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def _root_after(sub: argparse.ArgumentParser) -> None:
    """Accept `--root` after the subcommand too (`gr2 status --root DIR`); SUPPRESS keeps the global one when absent."""
    sub.add_argument("--root", default=argparse.SUPPRESS, help="project folder holding dvc.yaml (default: the global --root)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gr2", description="Diffusion-GR2 pipeline: train, measure, register and promote re-rankers.")
    parser.add_argument("--root", default=".", help="project folder holding dvc.yaml (default: current folder)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the pipeline (Prefect flow over the DVC stages; MLflow tracking)")
    run.add_argument("--stage", action="append", help="run up to and including this stage (repeatable); default all")
    run.add_argument("--force", action="store_true", help="rerun stages even if DVC finds them up to date")
    run.add_argument(
        "--launch", default=None, metavar="CMD",
        help='launcher of the multi-process stages, e.g. "accelerate launch --config_file configs/accelerate/1node-8gpu.yaml" '
        "(default: $GR2_LAUNCH; empty: one process)",
    )  # fmt: skip
    run.add_argument("-v", "--verbose", action="store_true", help="everything on the console too (default: one line per stage start and end; the rest in logs/<run>.log)")
    _root_after(run)
    run.set_defaults(fn=cmd_run)

    status = sub.add_parser("status", help="per stage: metrics written and when, headline metrics, whether DVC would rerun it")
    status.add_argument("--no-dvc", action="store_true", help="skip DVC's check of what is out of date (it hashes changed outputs)")
    _root_after(status)
    status.set_defaults(fn=cmd_status)

    stages = sub.add_parser("stages", help="list the stages in DVC order and whether each is up to date")
    _root_after(stages)
    stages.set_defaults(fn=cmd_stages)

    report = sub.add_parser("report", help="write reports/index.html: one offline page with the tables and figures of the metrics on disk")
    _root_after(report)
    report.add_argument("--no-mlflow", action="store_true", help="skip the training curves and the registry (MLflow not read)")
    report.set_defaults(fn=cmd_report)

    res = sub.add_parser("results", help="write docs/results.md from a workspace's metrics (ablation, ladder, speed, stage times, stamp) and the README's results table")
    _root_after(res)
    res.add_argument("--out", default="docs/results.md", help="the results page to write (default: docs/results.md)")
    res.add_argument("--readme", default="README.md", help="README whose results block (between its results markers) is rewritten (default: README.md)")
    res.add_argument("--no-readme", action="store_true", help="write the page only")
    res.add_argument("--label", default=None, help="how the page names the workspace, e.g. \"the default profile\" (default: its path)")
    res.set_defaults(fn=cmd_results)

    ws = sub.add_parser("workspace", help="copy the project into a new folder with a params profile (e.g. smoke)")
    ws.add_argument("dest")
    ws.add_argument("--profile", default=None, help="profiles/<name>.yaml merged over params.yaml")
    ws.add_argument("--data-dir", default=None, help="data folder for the copy (default: the project's prepare.data_dir)")
    ws.add_argument("--snapshot", action="store_true", help="version a copy of the data in DEST/raw with DVC (schedule.source = the data folder)")
    ws.add_argument("--remote", default=None, help="DVC default remote for the copy: a folder or URL (default: DEST/dvc-remote)")
    ws.set_defaults(fn=cmd_workspace)

    prom = sub.add_parser("promote", help="move a model's `champion` alias to a version through the gates in params.yaml (promote:)")
    prom.add_argument("model", help="registered model name: gr2, diffusion-gr2 or spec-gr2")
    prom.add_argument("--version", default=None, help="version to judge (default: the one aliased `challenger`)")
    prom.add_argument("--no-flow", action="store_true", help="run without Prefect (no flow run, no artifact); faster")
    prom.set_defaults(fn=cmd_promote)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bd = bench_sub.add_parser("decode", help="decode speed of GR2 (best AR decoder) vs the diffusion re-rankers and speculative decoding (diffusion drafts, GR2 verifies), in one run")
    bd.add_argument("--tau", type=float, action="append", help="commit threshold (repeatable; default: params evaluate.bench.taus)")
    bd.add_argument("--batch-size", type=int, action="append", help="batch size (repeatable; default: params)")
    bd.add_argument("--examples", type=int, default=None, help="first N test re-ranking examples (default: params)")
    bd.add_argument("--repeats", type=int, default=None, help="timed passes per row after the warm-up; the median is reported (default: params, 3)")
    bd.add_argument("--draft-mode", choices=["block", "window"], default=None, help="speculative drafting on the drafter's blocks or in a window (default: params)")
    bd.add_argument("--draft-len", type=int, default=None, help="tokens drafted per round (default: params)")
    bd.add_argument("--sub-block-cache", type=int, action="append", metavar="S", help="also decode the sub-block-S rows with the approximate sub-block cache (repeatable; default: params evaluate.bench.sub_block_cache_sizes)")
    bd.set_defaults(fn=cmd_bench_decode)
    bs = bench_sub.add_parser("serve", help="load-test a served re-ranker on loopback: no 5xx, valid rankings, latency percentiles")
    bs.add_argument("model", nargs="?", default=None, help="MODEL@ALIAS (default: diffusion-gr2@champion, else gr2@champion)")
    bs.add_argument("--requests", type=int, default=400, help="requests in all (default 400)")
    bs.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    bs.add_argument("--bad-share", type=float, default=0.2, help="share of malformed or oversized requests (default 0.2)")
    bs.add_argument("--max-new-tokens", type=int, default=16, help="max_new_tokens of the good requests (default 16)")
    bs.add_argument("--rows", type=int, default=64, help="good requests cycle over the first N test lists (default 64)")
    bs.add_argument("--seed", type=int, default=0, help="order of the mix")
    bs.add_argument("--out", default=None, help="also write the report as JSON here")
    bs.set_defaults(fn=cmd_bench_serve)

    sched = sub.add_parser("schedule", help="scheduled retraining (Prefect deployment gr2-retrain; params schedule:)")
    sched_sub = sched.add_subparsers(dest="schedule_command", required=True)
    ss = sched_sub.add_parser("serve", help="serve gr2-retrain on its schedule, starting a local Prefect server unless PREFECT_API_URL answers")
    ss.add_argument("--cron", default=None, help="cron expression (default: params schedule.cron)")
    ss.add_argument("--interval", type=float, default=None, help="run every N seconds instead of the cron (tests, demos)")
    ss.add_argument("--name", default="gr2-retrain", help="deployment name")
    ss.add_argument("--host", default="127.0.0.1", help="address of the server it starts")
    ss.add_argument("--port", type=int, default=4200, help="port of the server it starts")
    ss.add_argument("--no-server", action="store_true", help="never start a server: fail unless PREFECT_API_URL answers")
    ss.set_defaults(fn=cmd_schedule_serve)
    sr = sched_sub.add_parser("run", help="one retraining now: refresh data, rerun what changed, push, promote")
    sr.set_defaults(fn=cmd_schedule_run)

    rep = sub.add_parser("reproduce", help="rebuild a registered version from its git commit and DVC data hash; compare checkpoint and metrics")
    rep.add_argument("model", help="MODEL@ALIAS (e.g. gr2@champion), or MODEL with a version")
    rep.add_argument("version", nargs="?", default=None, help="version number when MODEL has no @ALIAS")
    rep.add_argument("--remote", default=None, help="DVC remote to restore data from (default: the project's default remote, else its cache)")
    rep.add_argument("--rtol", type=float, default=0.0, help="accept metrics within this relative tolerance when the checkpoint differs")
    rep.add_argument("--keep", action="store_true", help="keep the temporary worktree with the rebuilt outputs")
    rep.add_argument("--no-record", action="store_true", help="do not write the verdict as tags on the version")
    rep.set_defaults(fn=cmd_reproduce)

    chk = sub.add_parser("serve-check", help="serve a version and check its rankings equal, list for list, those of the evaluate row its eval numbers came from")
    chk.add_argument("model", help="MODEL@ALIAS (e.g. gr2@champion) or MODEL/VERSION")
    chk.add_argument("--split", default="test", choices=["valid", "test"], help="whose lists (default test)")
    chk.add_argument("--examples", type=int, default=64, help="the first N re-ranking lists of the split, in evaluate's order (default 64)")
    chk.add_argument("--batch", type=int, default=16, help="lists per request (default 16)")
    _root_after(chk)
    chk.set_defaults(fn=cmd_serve_check)

    srv = sub.add_parser("serve", help="serve a registered version over HTTP (MLflow's scoring protocol) with its request caps")
    srv.add_argument("model", help="MODEL@ALIAS (e.g. gr2@champion), MODEL/VERSION, models:/..., or a model folder")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    srv.add_argument("--port", type=int, default=5000)
    srv.set_defaults(fn=cmd_serve)

    data = sub.add_parser("data", help="data helpers")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    dl = data_sub.add_parser("download", help="download the public Amazon review files (5-core reviews + metadata)")
    dl.add_argument("--category", default="Beauty")
    dl.add_argument("--dest", default="data/raw/beauty")
    dl.set_defaults(fn=cmd_data_download)
    sn = data_sub.add_parser("snapshot", help="copy schedule.source into prepare.data_dir, dvc add it, commit the pointer, push")
    sn.add_argument("--source", default=None, help="folder to snapshot (default: params schedule.source)")
    sn.add_argument("--no-commit", action="store_true", help="do not commit the pointer file")
    sn.set_defaults(fn=cmd_data_snapshot)
    return parser


def main(argv: list[str] | None = None) -> int:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
