import atexit
import os
import shutil
import tempfile

import pytest

# Inductor's max-autotune (optimize_for_inference's CPU mode) benchmarks its own C++ GEMM templates against ATen's for
# every GEMM shape: 45 s of one 2-layer ViT's compile on a 2-core AMD EPYC, 20 s with ATen's alone. The tests check
# vitkit's compiled paths (freezing, inference mode, split bias), not Inductor's choice of GEMM: ATen's alone here,
# in this process and the subprocesses it starts (read when torch._inductor is first imported, after this).
os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")
import torch  # noqa: E402

# A fixed thread count everywhere, in this process and the training subprocesses: results do not depend on what the
# thread probe (runtime/threads.py) would pick on a busy or quiet machine; test_speed_choices.py tests the probe
# itself. Under pytest-xdist (two workers, one per core) one thread each, else two.
# (The xdist controller imports this file too, before it starts the workers, which inherit its environment: so a
# worker sets its own count rather than keeping the one it was handed.) Two workers of two threads each on two
# cores spin-wait for each other at every operator and ran the suite's training tests three to five times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    # The other libraries that start a thread per core, held to this worker's one: XLA (the JAX/Flax references)
    # and Inductor's compile workers.
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Two workers keep both cores busy: calibrations are cached all the same (test_round3.py tests the refusal)
os.environ.setdefault("VITKIT_CACHE_UNDER_LOAD", "1")
# vitkit's cache (decoded datasets, calibration timings) in a folder of this test session, not the user's
# (the xdist workers inherit it from the controller, which made it and removes it when the session ends: left behind,
# each run's 60 MB filled the CI machine's disk after a hundred runs)
if "VITKIT_CACHE_DIR" not in os.environ:
    os.environ["VITKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitkit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["VITKIT_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def bf16_keeps_up(monkeypatch):
    """A CPU whose bf16 matmuls keep up with fp32's (an AMX Xeon's), for the tests that replay its timings: where
    bf16 is emulated the planner does not time it at all (runtime/cpu.cpu_precisions)."""
    import vitkit.runtime.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "bf16_matmul_slowdown", lambda: 1.0)


def tiny_config(**kw):
    from vitkit import ViTConfig

    base = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **kw})


# The longest tests, longest first, handed out one at a time from the front of the queue (--maxschedchunk 1 in
# pyproject.toml) so that the two workers finish together instead of one of them running a long test alone at the
# end: those of the default run, then the long ones (-m long, which .ci/run runs after it). A new test of half a
# minute or more goes on this list.
LONG_FIRST = ("test_optimize_for_inference_with_compile_runs_and_agrees",
              "test_a_time_limited_run_evaluates_less_often_when_evaluating_is_dear_and_says_so",
              "test_hugging_face_hub_weights_load_as_transformers_loads_them",
              "test_compiled_training_step_gives_the_eager_loss_and_gradients",
              "test_workers_are_capped_and_a_stop_that_cannot_end_its_step_exits_within_seconds",
              # -m long
              "test_the_readme_tour_runs_in_order",  # (~20 minutes on a 2-core AVX2 EPYC: first, beside the rest)
              "test_real_browser_uploads_and_sees_prediction_and_overlay",
              "test_self_supervision_sets_the_recipes_hybrid_pre_trained_against_the_default",
              "test_site_builds_strict_offline_with_notebooks_figures_and_the_korean_edition",
              "test_a_downloaded_notebook_runs_top_to_bottom",
              "test_tutorial_runs_and_shows_what_it_prints[fine-tune]",
              "test_tutorial_runs_and_shows_what_it_prints[train-in-minutes]",
              "test_tutorial_runs_and_shows_what_it_prints[backbone]",
              "test_tutorial_runs_and_shows_what_it_prints[export-serve-scale]",
              "test_tutorial_runs_and_shows_what_it_prints[look-inside]",
              "test_under_a_real_container_limit_the_recipe_streams_plans_its_memory_and_trains",
              "test_ctrl_c_in_a_streamed_multi_process_run_is_said_once",
              "test_bench_time_to_accuracy_runs_the_readme_command_cold_and_reports_its_final_line",
              "test_tutorial_runs_and_shows_what_it_prints[why-did-it-say-that]",
              "test_fine_tune_and_linear_probe_from_dinov2_features",
              "test_tutorial_runs_and_shows_what_it_prints[why-vits-need-data]",
              "test_finetune_recipe_end_to_end_on_ants_bees")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.name, len(rank)))  # stable: the rest keep their order
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def one_process_group():
    """A process group of one (gloo on loopback): FSDP2 and DCP as a sharded run calls them."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
