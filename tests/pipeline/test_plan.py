"""The physical plan, the local engine's bounded prefetch, the Files reader's position, the sink."""

import threading
import time

import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest

from treeflow.pipeline import ArrowSink, Files, Pipeline, Plan
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.local import run_local
from treeflow.schemas import validate_episodes
from treeflow.stages import CostModel, Forward, Fragment, Loss, Pack, Reassemble, Reduce, Shard
from treeflow.stages.base import Stage
from treeflow.ops import build_forward


def small_eps(n=8, seed=0):
    return synth_episodes(episodes=n, group_size=2, turns=(2, 3), system_tokens=16,
                          user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                          seed=seed)


def test_plan_compiles_stage_kinds_into_three_operators():
    pack, frag, shard, fwd = Pack(), Fragment(max_tokens=64), Shard(), Forward()
    plan = Pipeline(pack, frag, shard, fwd, Reassemble()).plan
    assert plan.maps[:2] == (pack, frag) and plan.model is fwd
    assert plan.maps[2] == Shard(cost=CostModel.from_config(fwd.model_config()))
    assert isinstance(plan.accumulate, Reassemble) and not plan.fused
    assert plan.max_tokens == 64  # Fragment's bound, for padding flex bins
    train = Pipeline(pack, frag, fwd, Reduce()).plan
    assert train.fused and train.model is fwd  # the registry says Reduce holds Forward's model
    maps_only = Pipeline(pack, frag).plan
    assert maps_only.model is None and maps_only.accumulate is None


def test_plan_places_stages_by_their_registered_operator():
    # a stage of a new type compiles once an operator is registered for it, and is refused
    # at planning, by name, before that
    from treeflow.ops import MapOp, register
    from treeflow.ops.registry import _REGISTRY

    class Tag(Stage):
        input_schema = Pack.output_schema
        output_schema = Pack.output_schema

        def __call__(self, table):
            return table

    with pytest.raises(TypeError, match="Tag: no physical operator is registered for this stage"):
        Plan.compile((Pack(), Tag(), Fragment(max_tokens=64)))
    with pytest.raises(TypeError, match="Tag: no physical operator"):
        Pipeline(Pack(), Tag(), Fragment(max_tokens=64))
    register(Tag)(lambda stage, **runtime: MapOp(stage))
    try:
        plan = Plan.compile((Pack(), Tag(), Fragment(max_tokens=64)))
    finally:
        del _REGISTRY[Tag]
    assert [type(s).__name__ for s in plan.maps] == ["Pack", "Tag", "Fragment"]
    with pytest.raises(ValueError, match="Fragment \\(a map\\) follows the model stage Forward"):
        Plan.compile((Pack(), Forward(), Fragment(max_tokens=64)))


def test_shard_deals_by_the_cost_model_of_the_model_the_trainer_runs(tmp_path):
    # the plan binds the model's own cost model into a Shard left without one; the oracle is
    # the Trainer's, which derives it from the loaded model's config
    import json

    from treeflow.stages import CostModel
    from treeflow.train import Trainer

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fwd = Forward(model=str(tmp_path))
    trainer = Trainer(Forward(), Reduce())  # the tiny model's
    for forward, want in ((fwd, CostModel.from_config(fwd.model_config())),
                          (Forward(), trainer.cost_model)):
        plan = Pipeline(Pack(), Fragment(max_tokens=64), Shard(), forward,
                        Reassemble()).plan
        assert plan.maps[2].cost == want and want != CostModel.llama_1b()
    assert CostModel.from_config(fwd.model_config()) != trainer.cost_model  # another shape
    mine = CostModel.llama_1b()
    kept = Pipeline(Pack(), Fragment(max_tokens=64), Shard(cost=mine), fwd,
                    Reassemble()).plan
    assert kept.maps[2].cost is mine  # a cost model given is kept
    assert Pipeline(Pack(), Fragment(max_tokens=64), Shard()).plan.maps[2] \
        .cost_model() == CostModel.llama_1b()  # no model named: the documented default


def test_pack_and_fragment_deal_ranks_by_the_models_cost_model():
    # training with --num-ranks R deals the trees to the ranks in Pack and Fragment: by the
    # cost model the Trainer reckons with (the tiny model's), not a fixed 1B shape
    from treeflow.stages import RankBinding
    from treeflow.train import Trainer

    want = Trainer(Forward(), Reduce()).cost_model
    assert want != CostModel.llama_1b()
    plan = Pipeline(Pack(), Fragment(max_tokens=64), Shard(), Forward(),
                    Reduce()).plan.for_rank(2, 1)
    assert [s.cost for s in plan.maps] == [want, want, want]
    # Pack and Fragment deal (and are given the model's cost) only in a plan bound to ranks;
    # a user's own cost is kept
    mine = CostModel.llama_1b()
    one = Pipeline(Pack(cost=mine), Fragment(max_tokens=64), Forward(), Reassemble()).plan
    assert one.maps == (Pack(cost=mine), Fragment(max_tokens=64))
    kept = one.for_rank(2)
    assert kept.maps[0].cost == mine and kept.maps[1].cost == want
    # and the deal uses it: on a window whose trees the two cost models rank differently the
    # bins differ (tests/stages/test_deal.py holds the deal itself)
    eps = validate_episodes(synth_episodes(episodes=24, group_size=1, turns=(1, 6),
                                           system_tokens=4, user_tokens=(2, 40),
                                           completion_tokens=(2, 40), tool_tokens=(2, 40), seed=5))
    layouts = Pack().map(eps, step=0)
    by = {c: Fragment(max_tokens=4096, cost=c).map(layouts, step=0, binding=RankBinding(2))
          for c in (want, CostModel.llama_1b())}
    def deal(bins):
        return sorted((r, sorted(set(e))) for r, e in zip(bins.column("rank").to_pylist(),
                                                          bins.column("occ_sample_index").to_pylist()))

    assert deal(by[want]) != deal(by[CostModel.llama_1b()])


def test_cross_stage_mismatch_is_refused_at_declaration():
    with pytest.raises(ValueError, match=r"Reassemble needs \['edge_entropies'\], which no stage "
                                         "before it produces"):
        Pipeline(Pack(), Fragment(max_tokens=64), Forward(entropy=False), Reassemble(entropy=True))
    Pipeline(Pack(), Fragment(max_tokens=64), Forward(entropy=True), Reassemble(entropy=True))
    with pytest.raises(ValueError, match="Reduce needs"):
        Pipeline(Pack(), Fragment(max_tokens=64), Forward(),
                 Reduce(loss=Loss(kind="pg", entropy_coef=0.01)))


def test_forward_config_holds_no_device():
    assert "device" not in {f for f in Forward.__dataclass_fields__}
    runner = build_forward(Forward(), device="cpu", max_tokens=64)
    assert runner.device.type == "cpu" and runner.pad_to is None  # padding serves CUDA flex only


def test_local_engine_reads_a_bounded_number_of_windows_ahead():
    eps = validate_episodes(small_eps(4))
    pulled = []

    def source():
        for i in range(12):
            pulled.append(i)
            yield eps

    pipe = Pipeline(Pack(), Fragment(max_tokens=512), Forward(), Reassemble())
    # the preparing thread (an accelerator's default; on CPU windows are prepared in line)
    for k, rec in enumerate(run_local(pipe.plan, source(), prefetch=2, background=True)):
        time.sleep(0.2)  # give the preparing thread every chance to run ahead
        # prefetch windows queued + one being prepared + one held for overlap
        assert len(pulled) - (k + 1) <= 2 + 2, (k, len(pulled))
        assert rec.step == k and rec.stats["episodes"] == 4
    assert len(pulled) == 12


@pytest.mark.parametrize("background", [True, False])
def test_local_engine_delivers_windows_before_a_failing_one(background):
    eps = validate_episodes(small_eps(4))
    bad = eps.slice(0, 0)

    def source():
        yield eps
        yield eps
        raise RuntimeError("source broke")
        yield bad

    pipe = Pipeline(Pack(), Fragment(max_tokens=512), Forward(), Reassemble())
    got = []
    with pytest.raises(RuntimeError, match="source broke"):
        for rec in run_local(pipe.plan, source(), background=background):
            got.append(rec.step)
    assert got == [0, 1]


class _PlanWaitingForData(Plan):
    """A plan whose model builds only once the engine has pulled the first window."""

    pulled = None
    fail = False

    def worker(self, **kwargs):
        if self.fail:
            raise ValueError("no such checkpoint")
        assert self.pulled.wait(timeout=120), "the engine read nothing while the model loaded"
        return super().worker(**kwargs)


def _waiting_plan(fail=False):
    p = Pipeline(Pack(), Fragment(max_tokens=512), Forward(), Reassemble()).plan
    plan = _PlanWaitingForData(maps=p.maps, model=p.model, accumulate=p.accumulate,
                               max_tokens=p.max_tokens, fused=p.fused)
    object.__setattr__(plan, "pulled", threading.Event())
    object.__setattr__(plan, "fail", fail)
    return plan


def test_local_engine_reads_windows_while_the_model_loads():
    eps = validate_episodes(small_eps(4))
    plan = _waiting_plan()

    def source():
        for _ in range(3):
            plan.pulled.set()
            yield eps

    recs = list(run_local(plan, source(), background=True))
    assert [r.step for r in recs] == [0, 1, 2]
    assert recs[0].stats["load_seconds"] >= 0 and "compile_seconds" in recs[0].stats
    assert "load_seconds" not in recs[1].stats  # one-off costs go on the first window only


def test_local_engine_raises_a_model_that_fails_to_build():
    eps = validate_episodes(small_eps(4))
    for background in (True, False):
        with pytest.raises(ValueError, match="no such checkpoint"):
            list(run_local(_waiting_plan(fail=True), iter([eps] * 5), background=background))


def test_local_engine_prepares_in_line_when_the_model_runs_on_the_cpu():
    # a preparing thread beside the model's intra-op threads would oversubscribe the cores
    eps = validate_episodes(small_eps(4))
    threads = set()

    def source():
        for _ in range(3):
            threads.add(threading.get_ident())
            yield eps

    pipe = Pipeline(Pack(), Fragment(max_tokens=512), Forward(), Reassemble())
    assert len(list(pipe.run(source(), device="cpu"))) == 3
    assert threads == {threading.get_ident()}


def test_files_reader_position_resumes_and_cycles(tmp_path):
    write_episodes(small_eps(8), tmp_path / "e.arrow")
    files = Files(paths=(str(tmp_path / "e.arrow"),), episodes_per_step=2, cycle=True)
    reader = files.open()
    first = [next(reader) for _ in range(5)]  # 4 windows per pass: the 5th starts pass 2
    assert reader.state_dict() == {"episodes": 10, "passes": 1}
    resumed = files.open({"episodes": 6})
    again = [next(resumed) for _ in range(2)]
    assert [w.column("episode_id").to_pylist() for w in again] == \
        [w.column("episode_id").to_pylist() for w in first[3:5]]
    with pytest.raises(ValueError, match="not at a window boundary"):
        next(files.open({"episodes": 3}))
    once = Files(paths=files.paths, episodes_per_step=2)
    assert sum(w.num_rows for w in once) == 8


def test_old_window_names_fail_naming_the_new_one(tmp_path):
    """`window=` had its release with a warning; now it is refused in one line naming
    `episodes_per_step` (as the command line's --window is)."""
    write_episodes(small_eps(8), tmp_path / "e.arrow")
    paths = (str(tmp_path / "e.arrow"),)
    with pytest.raises(TypeError, match=r"^Files\(window=2\) is now Files\(episodes_per_step=2\)"):
        Files(paths=paths, window=2)
    pipe = Pipeline(Pack(), Fragment(max_tokens=512))
    with pytest.raises(TypeError, match=r"Pipeline.run\(window=4\) is now Pipeline.run\("
                                        r"episodes_per_step=4\)"):
        pipe.run(paths[0], window=4)
    assert [r.stats["episodes"] for r in pipe.run(paths[0], episodes_per_step=4)] == [4, 4]


def test_files_spans_cut_windows_like_iteration(tmp_path):
    a = small_eps(6, seed=1)
    b = a.set_column(0, "episode_id", pa.array([f"b{i}" for i in range(6)]))
    b = b.set_column(b.schema.get_field_index("sample_index"), "sample_index",
                     pa.array(range(6, 12), pa.int64()))
    write_episodes(a, tmp_path / "a.arrow")
    write_episodes(b, tmp_path / "b.parquet")
    files = Files(paths=(str(tmp_path / "a.arrow"), str(tmp_path / "b.parquet")), episodes_per_step=4)
    sizes = [w.num_rows for w in files]
    spans = files.spans()
    assert [sum(b - a for _, a, b, _ in pieces) for pieces in spans] == sizes
    assert any(len(pieces) == 2 for pieces in spans)  # a window across the two files


def test_sink_publishes_atomically(tmp_path):
    out = tmp_path / "r.parquet"
    table = pa.table({"x": [1, 2]})
    with ArrowSink(out) as sink:
        sink.write(table)
        assert not out.exists()  # only the unique temporary exists while writing
    assert pa.parquet.read_table(out).equals(table)
    with pytest.raises(RuntimeError):
        with ArrowSink(tmp_path / "s.arrow") as sink:
            sink.write(table)
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]
