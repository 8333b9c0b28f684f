"""Promotion gates, the decision record, race safety, the evidence tags, the CLI and the Prefect flow.

Versions here are registry entries with tags only (no model files): promotion
reads nothing but tags, so a SQLite store in a temporary folder is enough. Each
test uses its own model name in one module-wide store.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.promote import (
    CHAMPION,
    Decision,
    ModelGates,
    PromoteConfig,
    PromotionBusy,
    PromotionConflict,
    PromotionError,
    SpeedGate,
    commit,
    decide,
    eval_tag,
    _speed_tags,
    _why,
    judge,
    load_promote_config,
    lock_path,
    promote,
    promotion_lock,
    record_evaluations,
    speed_tag,
)
from flows.registry import CHALLENGER, DecoderSetting, ModelStage

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

GATES = ModelGates(split="test", metrics=["recall@1", "ndcg@3"], tolerance=0.005, min_valid_permutation=0.99)
DIFFUSION_GATES = GATES.model_copy(update={"speed": SpeedGate(min_speedup=2.0, tau=0.9, batch_size=1)})
AR = DecoderSetting(decoder="ar")
# evaluate's accuracy-table setting (params.yaml evaluate: tau 0.9, sub-blocks of 8, no cache, no grammar): what a
# diffusion version is registered to serve.
SERVED = DecoderSetting(decoder="diffusion", tau=0.9, sub_block_size=8)
MD5 = "c1.dir"


def evals(r1: float, n3: float, valid: float = 1.0, split: str = "test", setting: DecoderSetting = AR, measured_on: str = MD5) -> dict[str, str]:
    """A version's tags as record_evaluations writes them: its checkpoint and setting, and evaluate's numbers."""
    return {
        "checkpoint_md5": MD5, **setting.tags(), "eval.checkpoint_md5": measured_on, "eval.setting": setting.label(), "eval.grammar": "false",
        eval_tag(split, "recall@1"): str(r1), eval_tag(split, "ndcg@3"): str(n3), eval_tag(split, "valid_permutation_rate"): str(valid),
    }  # fmt: skip


def speeds(speedup: float, setting: DecoderSetting = SERVED, measured_on: str = MD5) -> dict[str, str]:
    return {"speed.checkpoint_md5": measured_on, "speed.setting": setting.label(), speed_tag(0.9, 1, "speedup"): str(speedup)}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"


@pytest.fixture()
def client(store: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store, registry_uri=store)


@pytest.fixture()
def model_name(request: pytest.FixtureRequest) -> str:
    return "m-" + request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:60]


def add_version(client, name: str, tags: dict[str, str], challenger: bool = True) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already there
    mv = client.create_model_version(name, source="file:///nonexistent/model", tags=tags, await_creation_for=0)
    if challenger:
        client.set_registered_model_alias(name, CHALLENGER, str(mv.version))
    return str(mv.version)


def champion(client, name: str) -> str | None:
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    return None if version is None else str(version)


def run_promote(client, name: str, gates: ModelGates = GATES, version: str | None = None, root: Path = ROOT) -> Decision:
    return promote(name, version, root, PromoteConfig(lock_timeout_s=5, models={name: gates}), client=client, refresh=False)


# --- config ---------------------------------------------------------------------------------


def test_project_params_have_gates_for_both_rerankers() -> None:
    cfg = load_promote_config(ROOT)
    assert cfg.models["gr2"].min_valid_permutation == 0.99 and cfg.models["gr2"].speed is None
    assert cfg.models["diffusion-gr2"].speed is not None and cfg.models["diffusion-gr2"].speed.batch_size == 1
    assert set(cfg.models["gr2"].metrics) == {"recall@1", "ndcg@3"}


def test_bad_gate_params_name_the_field(tmp_path: Path, client) -> None:
    params = {"promote": {"models": {"gr2": {"tolerence": 0.01, "min_valid_permutation": "high"}}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(PromotionError) as err:
        promote("gr2", None, tmp_path, client=client)
    assert "promote.models.gr2.tolerence" in str(err.value) and "promote.models.gr2.min_valid_permutation" in str(err.value)


def test_unknown_model_or_version_is_a_clear_error(client, model_name: str) -> None:
    with pytest.raises(PromotionError, match="no promotion gates for 'nope'"):
        promote("nope", None, ROOT, PromoteConfig(models={}), client=client, refresh=False)
    with pytest.raises(PromotionError, match="no registered model"):
        run_promote(client, model_name)
    add_version(client, model_name, evals(0.3, 0.4), challenger=False)
    with pytest.raises(PromotionError, match="no version with alias 'challenger'"):
        run_promote(client, model_name)
    with pytest.raises(PromotionError, match="has no version 7"):
        run_promote(client, model_name, version="7")


# --- gates (pure) ---------------------------------------------------------------------------


def test_judge_tolerance_boundary_and_missing_numbers() -> None:
    champ = evals(0.300, 0.400)
    at_edge = {g.name: g for g in judge(evals(0.295, 0.395), champ, GATES)}
    assert all(g.passed for g in at_edge.values())
    assert at_edge["recall@1 (test)"].threshold == pytest.approx(0.295)
    below = {g.name: g for g in judge(evals(0.2949, 0.41), champ, GATES)}
    assert not below["recall@1 (test)"].passed and below["ndcg@3 (test)"].passed
    missing = {g.name: g for g in judge({}, champ, GATES)}
    assert not any(g.passed for name, g in missing.items() if name != "evidence (dvc.lock)")  # no numbers: none to doubt
    assert "no tag eval.test.recall_at_1" in missing["recall@1 (test)"].note
    no_champ_numbers = {g.name: g for g in judge(evals(0.3, 0.4), {}, GATES)}
    assert "the champion has no tag" in no_champ_numbers["recall@1 (test)"].note


def test_judge_speed_gate() -> None:
    fast = {**evals(0.3, 0.4, setting=SERVED), **speeds(2.4)}
    slow = {**evals(0.3, 0.4, setting=SERVED), **speeds(1.7), speed_tag(0.5, 1, "speedup"): "3.1"}
    assert all(g.passed for g in judge(fast, None, DIFFUSION_GATES))
    gate = judge(slow, None, DIFFUSION_GATES)[-1]
    assert gate.name == "speedup (tau 0.9, batch 1)" and not gate.passed and gate.value == 1.7 and gate.threshold == 2.0
    unmeasured = judge(evals(0.3, 0.4, setting=SERVED), None, DIFFUSION_GATES)[-1]
    assert not unmeasured.passed and "not measured" in unmeasured.note and "tau 0.9, batch 1" in unmeasured.note


def test_judge_refuses_unverified_numbers() -> None:
    """Numbers dvc.lock could not tie to the checkpoint (record_evaluations' `unverified`) promote nothing."""
    gates = {g.name: g for g in judge({**evals(0.3, 0.4, setting=SERVED, measured_on="unverified"), **speeds(2.4)}, None, DIFFUSION_GATES)}
    evidence = gates["evidence (dvc.lock)"]
    assert not evidence.passed and "the eval numbers are unverified: dvc.lock does not tie metrics/evaluate.json" in evidence.note
    assert all(g.passed for name, g in gates.items() if name != "evidence (dvc.lock)")  # the numbers alone would pass
    speed = {g.name: g for g in judge({**evals(0.3, 0.4, setting=SERVED), **speeds(2.4, measured_on="unverified")}, None, DIFFUSION_GATES)}
    assert not speed["evidence (dvc.lock)"].passed and "the speed numbers are unverified" in speed["evidence (dvc.lock)"].note
    other = {g.name: g for g in judge(evals(0.3, 0.4, measured_on="old.dir"), None, GATES)}
    assert "measured on checkpoint old.dir, the version is c1.dir" in other["evidence (dvc.lock)"].note


def test_judge_refuses_a_validity_measured_under_the_grammar() -> None:
    """Under the answer grammar every answer is valid (1.0 by construction): that is no evidence of the model's format."""
    grammar_only = {**evals(0.3, 0.4, valid=1.0), "eval.grammar": "true"}
    gate = next(g for g in judge(grammar_only, None, GATES) if g.name == "valid_permutation_rate (test)")
    assert not gate.passed and gate.value == 1.0 and "measured under the answer grammar" in gate.note
    assert gate.name + ": measured under the answer grammar" in _why(gate)  # not "1.0000 < 0.9900"
    own = next(g for g in judge(evals(0.3, 0.4, valid=0.97), None, GATES) if g.name == "valid_permutation_rate (test)")
    assert not own.passed and own.value == 0.97  # the model's own answers, 3% invalid


def test_judge_reads_permutations_not_parsable_answers() -> None:
    """An answer that parses but repeats a candidate is served as the incoming order: the gate counts it invalid
    (dgr2 on the default profile: valid format 0.9957, valid permutations 0.9788)."""
    tags = {**evals(0.3, 0.4, valid=0.9788), eval_tag("test", "valid_format_rate"): "0.9957"}
    gate = next(g for g in judge(tags, None, GATES) if g.name.startswith("valid"))
    assert gate.name == "valid_permutation_rate (test)" and gate.value == 0.9788 and not gate.passed


def test_judge_refuses_numbers_of_another_decoder_setting() -> None:
    loose = SERVED.model_copy(update={"sub_block_size": None, "explanation_tau": 0.3, "explanation_sub_block_size": 32, "grammar": True})
    tags = {**evals(0.3, 0.4, setting=SERVED), **speeds(2.48, setting=loose)}
    gate = next(g for g in judge(tags, None, DIFFUSION_GATES) if g.name == "decoder setting")
    assert not gate.passed and "the speed numbers were measured with diffusion: tau 0.9, whole blocks, explanation at tau 0.3" in gate.note
    assert "the version serves diffusion: tau 0.9, sub-blocks of 8, explanation as the answer, no grammar" in gate.note
    untold = {k: v for k, v in evals(0.3, 0.4).items() if not k.startswith("decoder.")}
    assert not next(g for g in judge(untold, None, GATES) if g.name == "decoder setting").passed


# --- decisions in the registry --------------------------------------------------------------


def test_first_gated_version_becomes_champion_then_nothing_to_do(client, model_name: str) -> None:
    v = add_version(client, model_name, evals(0.30, 0.40))
    d = run_promote(client, model_name)
    assert d.status == "promoted" and d.champion_before is None
    assert champion(client, model_name) == v
    tags = client.get_model_version(model_name, v).tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.champion_before"] == "none"
    assert {g["name"]: g for g in json.loads(tags["promotion.gates"])}["recall@1 (test)"]["value"] == 0.30
    again = run_promote(client, model_name)
    assert again.status == "already-champion" and champion(client, model_name) == v


def test_first_version_must_still_pass_absolute_gates(client, model_name: str) -> None:
    v = add_version(client, model_name, evals(0.30, 0.40, valid=0.95))
    d = run_promote(client, model_name)
    assert d.status == "refused" and champion(client, model_name) is None
    assert "valid_permutation_rate (test) 0.9500 < 0.9900" in d.summary() and "still no champion" in d.summary()
    assert client.get_model_version(model_name, v).tags["promotion.failed_gates"] == "valid_permutation_rate (test)"


def test_refusal_names_the_gate_and_numbers_and_keeps_the_champion(client, model_name: str) -> None:
    v1 = add_version(client, model_name, evals(0.30, 0.40))
    run_promote(client, model_name)
    v2 = add_version(client, model_name, evals(0.28, 0.41))
    d = run_promote(client, model_name)
    assert d.status == "refused" and champion(client, model_name) == v1
    assert f"REFUSED {model_name} version {v2} (champion stays version {v1})" in d.summary()
    assert "recall@1 (test) 0.2800 < 0.2950 (rule >= champion - 0.005)" in d.summary()
    assert "ndcg@3" not in d.summary()  # only failed gates are reasons
    table = d.table()
    assert "recall@1 (test)" in table and "FAIL" in table and "0.3000" in table  # the champion's number too
    tags = client.get_model_version(model_name, v2).tags
    assert tags["promotion.decision"] == "refused" and tags["promotion.champion_before"] == v1
    gates = {g["name"]: g for g in json.loads(tags["promotion.gates"])}
    assert gates["recall@1 (test)"]["value"] == 0.28 and gates["recall@1 (test)"]["reference"] == 0.30


def test_within_tolerance_promotes_and_marks_the_old_champion(client, model_name: str) -> None:
    v1 = add_version(client, model_name, evals(0.30, 0.40))
    run_promote(client, model_name)
    v2 = add_version(client, model_name, evals(0.297, 0.399))
    d = run_promote(client, model_name)
    assert d.promoted and champion(client, model_name) == v2
    assert client.get_model_version(model_name, v1).tags["promotion.replaced_by"] == v2
    assert str(client.get_registered_model(model_name).aliases[CHALLENGER]) == v2  # the challenger alias is left alone


def test_explicit_version(client, model_name: str) -> None:
    v1 = add_version(client, model_name, evals(0.30, 0.40), challenger=False)
    add_version(client, model_name, evals(0.10, 0.10))
    assert run_promote(client, model_name, version=v1).promoted and champion(client, model_name) == v1


def test_diffusion_needs_the_speed_floor(client, model_name: str) -> None:
    v1 = add_version(client, model_name, {**evals(0.30, 0.40, setting=SERVED), **speeds(1.8)})
    d = run_promote(client, model_name, DIFFUSION_GATES)
    assert d.status == "refused" and "speedup (tau 0.9, batch 1) 1.8000 < 2.0000" in d.summary()
    client.set_model_version_tag(model_name, v1, speed_tag(0.9, 1, "speedup"), "2.6")
    assert run_promote(client, model_name, DIFFUSION_GATES).promoted


# --- race safety ----------------------------------------------------------------------------


def test_two_racing_promotions_exactly_one_wins(client, model_name: str) -> None:
    """Both judge against 'no champion', then both commit at once: one wins, the other changes nothing."""
    va = add_version(client, model_name, evals(0.30, 0.40))
    vb = add_version(client, model_name, evals(0.31, 0.41))
    decisions = [decide(client, model_name, v, GATES) for v in (va, vb)]
    assert all(d.promoted and d.champion_before is None for d in decisions)
    lock = lock_path(model_name, ROOT, client.tracking_uri)
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def go(d: Decision) -> None:
        barrier.wait()
        try:
            results[d.version] = commit(client, d, lock, timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[d.version] = exc

    threads = [threading.Thread(target=go, args=(d,)) for d in decisions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [v for v, r in results.items() if isinstance(r, Decision)]
    losers = [r for r in results.values() if not isinstance(r, Decision)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], PromotionConflict)
    assert "the champion changed from none to" in str(losers[0]) and "nothing was changed" in str(losers[0])
    assert champion(client, model_name) == winners[0]
    loser_version = ({va, vb} - set(winners)).pop()
    assert not any(k.startswith("promotion.") for k in client.get_model_version(model_name, loser_version).tags)


def test_a_held_lock_makes_the_other_promotion_fail_clearly(client, model_name: str) -> None:
    add_version(client, model_name, evals(0.30, 0.40))
    d = decide(client, model_name, None, GATES)
    lock = lock_path(model_name, ROOT, client.tracking_uri)
    assert lock.parent == Path(client.tracking_uri[len("sqlite:///") :]).parent  # next to the SQLite store
    with promotion_lock(lock, timeout_s=1):
        with pytest.raises(PromotionBusy, match=r"another promotion holds .* \(pid \d+ since"):
            commit(client, d, lock, timeout_s=0.3)
    assert champion(client, model_name) is None
    assert commit(client, d, lock, timeout_s=1).promoted  # released


def test_a_failure_after_moving_the_alias_puts_it_back(client, model_name: str) -> None:
    v1 = add_version(client, model_name, evals(0.30, 0.40))
    run_promote(client, model_name)
    add_version(client, model_name, evals(0.31, 0.41))
    d = decide(client, model_name, None, GATES)

    class Flaky:
        """The real client, except that writing tags fails (e.g. the store went away)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def set_model_version_tag(self, *args: Any) -> None:
            raise RuntimeError("store unavailable")

    with pytest.raises(RuntimeError, match="store unavailable"):
        commit(Flaky(), d, lock_path(model_name, ROOT, client.tracking_uri), timeout_s=1)
    assert champion(client, model_name) == v1


def _race_in_process(store: str, name: str, version: str, barrier: Any, out: Any) -> None:
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=store, registry_uri=store)
    d = decide(c, name, version, GATES)
    barrier.wait()
    try:
        commit(c, d, lock_path(name, ROOT, store), timeout_s=20)
        out.put((version, "won"))
    except PromotionConflict as exc:
        out.put((version, f"conflict: {exc}"))


@pytest.mark.integration
def test_two_processes_racing(store: str, client, model_name: str) -> None:
    va = add_version(client, model_name, evals(0.30, 0.40))
    vb = add_version(client, model_name, evals(0.31, 0.41))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_in_process, args=(store, model_name, v, barrier, out)) for v in (va, vb)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(r.split(":")[0] for r in results.values()) == ["conflict", "won"], results
    winner = next(v for v, r in results.items() if r == "won")
    assert champion(client, model_name) == winner


# --- evidence tags from the workspace's metrics files ---------------------------------------


EVALUATED_WITH = {"tau": 0.9, "sub_block_size": 8, "sub_block_cache": False, "grammar_rows": True}  # evaluate's params in dvc.lock
EVALUATION = {"dgr2-cft": {"test": {"recall@1": 0.291, "ndcg@3": 0.41, "valid_permutation_rate": 0.992, "n": 1615}}}


def _workspace(
    tmp_path: Path, ckpt_md5: str, evaluated_md5: str | None, evaluated_with: dict[str, Any] = EVALUATED_WITH,
    evaluation: dict[str, Any] = EVALUATION,
) -> Path:
    """A fake project root: dvc.lock with a cft stage and an evaluate stage that read its checkpoint (None: whose
    deps do not list it), evaluate's headline row of dgr2-cft and the real-shaped bench of tests/fixtures/speed.json."""
    deps = [{"path": "checkpoints/dgr2-cft", "md5": evaluated_md5}] if evaluated_md5 else []
    lock = {
        "schema": "2.0",
        "stages": {
            "cft": {
                "cmd": "python -m tasks.cft",
                "params": {"params.yaml": {"cft": {"block_size": 32}}},
                "outs": [{"path": "checkpoints/dgr2-cft", "md5": ckpt_md5}],
            },
            "evaluate": {
                "cmd": "python -m tasks.evaluate",
                "deps": deps,
                "params": {"params.yaml": {"evaluate": evaluated_with}},
                "outs": [{"path": "metrics/evaluate.json", "md5": "e"}, {"path": "metrics/speed.json", "md5": "s"}],
            },
        },
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/evaluate.json").write_text(json.dumps(evaluation))
    shutil.copy(FIXTURES / "speed.json", tmp_path / "metrics/speed.json")
    return tmp_path


@pytest.fixture()
def cft_stage(monkeypatch: pytest.MonkeyPatch, model_name: str) -> ModelStage:
    spec = ModelStage("cft", model_name, "checkpoints/dgr2-cft", decoder="diffusion")
    monkeypatch.setattr("flows.promote.MODEL_STAGES", {"cft": spec})
    return spec


def _fixture_rows() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "speed.json").read_text())["rows"]


def project_gates(model: str) -> PromoteConfig:
    return PromoteConfig(models={model: load_promote_config(ROOT).models["diffusion-gr2"]})


def test_record_evaluations_tags_the_version_of_that_checkpoint(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "abc.dir", "abc.dir")
    stale = {speed_tag(0.5, 1, "speedup"): "3.4", "eval.test.ndcg_at_5": "0.5"}  # left by an earlier record of another setting
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir", "stage": "cft", **SERVED.tags(), **stale})
    other = add_version(client, model_name, {"checkpoint_md5": "old.dir", "stage": "cft", **SERVED.tags()})
    done = record_evaluations(root, client)
    assert done == [{"model": model_name, "version": v, "stage": "cft", "tagged": ["eval", "speed"]}]
    tags = client.get_model_version(model_name, v).tags
    assert float(tags["eval.test.recall_at_1"]) == 0.291 and float(tags["eval.test.valid_permutation_rate"]) == 0.992
    assert tags["eval.model"] == "dgr2-cft" and tags["eval.checkpoint_md5"] == "abc.dir" and tags["eval.grammar"] == "false"
    assert tags["eval.setting"] == tags["speed.setting"] == SERVED.label()
    # The served setting's rows (tau 0.9, sub-blocks of 8, no grammar), one per batch size, and nothing else.
    assert float(tags[speed_tag(0.9, 1, "speedup")]) == 0.8401 and float(tags[speed_tag(0.9, 16, "speedup")]) == 0.3105
    assert float(tags[speed_tag(0.9, 1, "seconds_per_example")]) == 0.0857 and float(tags[speed_tag(0.9, 1, "repeats")]) == 3
    assert float(tags[speed_tag(0.9, 1, "tokens_per_s_speedup")]) == 0.8342
    assert not set(stale) & set(tags)  # the old setting's numbers are gone with their section
    assert len(tags["dvc.params.md5"]) == 32
    # the description now carries the numbers the version was evaluated with, and how it is served
    description = client.get_model_version(model_name, v).description
    assert "Evaluation (test, n=1615): R@1 0.2910" in description and f"Served with {SERVED.label()}." in description
    assert not any(k.startswith(("eval.", "speed.")) for k in client.get_model_version(model_name, other).tags)
    # The project's gates judge the served row: 0.84x, short of 2.0x, whatever the looser rows did.
    d = promote(model_name, v, root, project_gates(model_name), client=client)
    assert d.status == "refused" and [g.name for g in d.failed] == ["speedup (tau 0.9, batch 1)"], d.table()
    assert "speedup (tau 0.9, batch 1) 0.8401 < 2.0000" in d.summary()


def test_explanation_threshold_rows_cannot_pass_the_speed_gate(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    """The bad case of the real bench: at tau 0.9, whole blocks, the explanation at 0.3 runs at 2.48x (repeating
    words), 0.5 at 1.67x; keyed by tau and batch size alone, the last such row written passed the 2.0x gate."""
    rows = _fixture_rows()
    loose = [r for r in rows if r["model"] == "dgr2-cft" and r["tau"] == 0.9 and r["batch_size"] == 1 and r["explanation_tau"] is not None]
    assert max(r["speedup"] for r in loose) >= 2.0  # the fixture holds the trap
    root = _workspace(tmp_path, "abc.dir", "abc.dir")
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir", **SERVED.tags()})
    record_evaluations(root, client)
    assert float(client.get_model_version(model_name, v).tags[speed_tag(0.9, 1, "speedup")]) == 0.8401
    assert promote(model_name, v, root, project_gates(model_name), client=client).status == "refused"
    # Two rows that would write one tag make the speed ambiguous: refused, not "last one wins".
    served = [r for r in rows if SERVED.matches(r) and r["model"] == "dgr2-cft" and r["batch_size"] == 1]
    assert len(served) == 1
    with pytest.raises(ValueError, match="two rows of dgr2-cft"):
        _speed_tags("abc.dir", [served[0], {**served[0], "speedup": 2.5}], SERVED)
    with pytest.raises(ValueError, match="another setting"):
        _speed_tags("abc.dir", loose, SERVED)


def test_no_tag_key_is_written_twice(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "abc.dir", "abc.dir")
    add_version(client, model_name, {"checkpoint_md5": "abc.dir", **SERVED.tags()})
    add_version(client, model_name, {"checkpoint_md5": "abc.dir"})  # registered before settings were recorded
    written: list[tuple[str, str, str]] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def set_model_version_tag(self, model: str, version: str, key: str, value: str) -> None:
            written.append((model, version, key))
            client.set_model_version_tag(model, version, key, value)

    done = record_evaluations(root, Recording())
    assert len(done) == 2 and written
    assert len(written) == len(set(written)), sorted(k for k in written if written.count(k) > 1)


def test_a_version_from_before_settings_gets_its_legacy_setting_and_not_others_numbers(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "abc.dir", "abc.dir")
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir"})
    assert record_evaluations(root, client)[0]["tagged"] == []
    tags = client.get_model_version(model_name, v).tags
    # What its pyfunc serves: whole blocks at tau 0.9, no grammar; evaluate decoded sub-blocks of 8.
    assert DecoderSetting.from_tags(tags) == DecoderSetting(decoder="diffusion", tau=0.9)
    assert "the version serves diffusion: tau 0.9, whole blocks" in tags["eval.not_attached"]
    assert "no row of dgr2-cft at the served setting" in tags["speed.not_attached"]
    d = promote(model_name, v, root, project_gates(model_name), client=client)
    assert d.status == "refused" and "evaluate decoded dgr2-cft with diffusion: tau 0.9, sub-blocks of 8" in d.summary()


def test_unverified_numbers_are_refused_with_the_reason(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "abc.dir", None)  # evaluate's deps do not list the checkpoint: dvc.lock cannot say
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir", **SERVED.tags()})
    assert record_evaluations(root, client)[0]["tagged"] == ["eval", "speed"]
    tags = client.get_model_version(model_name, v).tags
    assert tags["eval.checkpoint_md5"] == tags["speed.checkpoint_md5"] == "unverified"
    relaxed = ModelGates(tolerance=1.0, min_valid_permutation=0.0, speed=SpeedGate(min_speedup=0.5, tau=0.9, batch_size=1))
    d = promote(model_name, v, root, PromoteConfig(models={model_name: relaxed}), client=client)
    assert d.status == "refused" and [g.name for g in d.failed] == ["evidence (dvc.lock)"], d.table()
    assert "the eval numbers are unverified: dvc.lock does not tie metrics/evaluate.json to this version's checkpoint" in d.summary()
    assert "the speed numbers are unverified" in d.summary()


def test_a_grammar_only_validity_is_not_the_models(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    """A headline row decoded under the grammar (its grammar_changed_rate; every answer valid) is not the served setting."""
    grammar_row = {"test": {**EVALUATION["dgr2-cft"]["test"], "valid_permutation_rate": 1.0, "grammar_changed_rate": 0.06}}
    root = _workspace(tmp_path, "abc.dir", "abc.dir", evaluation={"dgr2-cft": grammar_row})
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir", **SERVED.tags()})
    assert record_evaluations(root, client)[0]["tagged"] == ["speed"]
    d = promote(model_name, v, root, project_gates(model_name), client=client)
    gate = next(g for g in d.gates if g.name == "valid_permutation_rate (test)")
    assert not gate.passed and gate.value is None and "under the answer grammar" in gate.note, d.table()


def test_numbers_at_another_evaluate_setting_are_not_attached(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "abc.dir", "abc.dir", evaluated_with={**EVALUATED_WITH, "sub_block_size": None})
    v = add_version(client, model_name, {"checkpoint_md5": "abc.dir", **SERVED.tags()})
    assert record_evaluations(root, client)[0]["tagged"] == ["speed"]
    assert "evaluate decoded dgr2-cft with diffusion: tau 0.9, whole blocks" in client.get_model_version(model_name, v).tags["eval.not_attached"]


def test_numbers_measured_on_another_checkpoint_are_not_attached(tmp_path: Path, client, model_name: str, cft_stage: ModelStage) -> None:
    root = _workspace(tmp_path, "new.dir", "stale.dir")
    v = add_version(client, model_name, {"checkpoint_md5": "new.dir", **SERVED.tags()})
    assert record_evaluations(root, client)[0]["tagged"] == []
    assert not any(k.startswith(("eval.", "speed.")) and not k.endswith("not_attached") for k in client.get_model_version(model_name, v).tags)
    # and so the version cannot be promoted on them
    d = promote(model_name, v, root, PromoteConfig(models={model_name: DIFFUSION_GATES}), client=client)
    assert d.status == "refused" and "not evaluated" in d.summary() and "measured on checkpoint stale.dir" in d.summary()


# --- CLI and Prefect flow -------------------------------------------------------------------


@pytest.fixture()
def cli_root(tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, model_name: str) -> Path:
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    params = {"promote": {"lock_timeout_s": 5, "models": {model_name: GATES.model_dump()}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    # The CLI's MlflowClient() reads MLflow's global URI, which another test may have set;
    # set ours and afterwards put back exactly what was there (None = not set), or later
    # tests (the smoke pipeline) would write to this store.
    before = tracking_utils._tracking_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    yield tmp_path
    mlflow.set_tracking_uri(before)


def test_cli_promote_prints_the_decision_and_exit_codes(cli_root: Path, client, model_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    add_version(client, model_name, evals(0.30, 0.40))
    assert main(["--root", str(cli_root), "promote", model_name, "--no-flow"]) == 0
    out = capsys.readouterr().out
    assert f"PROMOTED {model_name} version 1 to champion (before: no champion)" in out and "recall@1 (test)" in out
    add_version(client, model_name, evals(0.20, 0.40))
    assert main(["--root", str(cli_root), "promote", model_name, "--no-flow"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "recall@1 (test) 0.2000 < 0.2950" in out and "FAIL" in out
    assert main(["--root", str(cli_root), "promote", "not-configured", "--no-flow"]) == 2


@pytest.mark.integration
def test_promote_flow_records_a_markdown_artifact(prefect_harness, cli_root: Path, client, model_name: str) -> None:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.promote import promote_flow

    v = add_version(client, model_name, evals(0.30, 0.40, valid=0.5))
    result = promote_flow(model_name, None, str(cli_root))
    assert result["status"] == "refused" and not result["promoted"]
    tags = client.get_model_version(model_name, v).tags
    assert tags["promotion.prefect_flow_run_id"]  # the decision names its flow run
    key = "gr2-promote-" + model_name

    async def read() -> list[Any]:
        async with get_client() as pc:
            return await pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    artifacts = asyncio.run(read())
    assert len(artifacts) == 1 and artifacts[0].type == "markdown"
    assert "REFUSED" in artifacts[0].data and "| valid_permutation_rate (test) | 0.5000 |" in artifacts[0].data
    assert str(artifacts[0].flow_run_id) == tags["promotion.prefect_flow_run_id"]
