"""`vitkit tune` (cli/tune_cmd.py, training/study.py; the run's own tuning of its settings is tests/test_tune.py):
the search space's parsing, trials as run folders validated on held-out training images, a study continued by the
same command, pruning by the median, and two processes sharing one study. The study is read back with Optuna's own
API, not through vitkit."""
import json
import os
import subprocess
import sys

import pytest

from vitkit.cli.main import main
from vitkit.training.config import TrainConfig
from vitkit.training.study import Dimension, parse_space, suggest

optuna = pytest.importorskip("optuna")

FAST = ["--compile", "false", "--precision", "fp32", "--attention", "sdpa", "--channels-last", "false",
        "--threads", "1"]


def test_space_parses_ranges_multiples_and_choices():
    dims = parse_space(["lr=x0.25..x4:log", "weight_decay=0.01..0.3", "opt=adamw|sgd", "warmup_epochs=1..5",
                        "batch_size=32..128:log", "hflip=true|false"])
    lr, wd, opt, warm, batch, flip = dims
    assert lr == Dimension("lr", 0.25, 4.0, log=True, relative=True)
    assert lr.bounds(0.002) == pytest.approx((0.0005, 0.008))
    assert wd.bounds(123) == (0.01, 0.3) and not wd.log
    assert opt.choices == ("adamw", "sgd") and flip.choices == (True, False)
    assert batch.integer and batch.log and not warm.integer  # warmup_epochs is a float field
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        v = suggest(study.ask(), dims, TrainConfig(lr=0.002))
        assert 0.0005 <= v["lr"] <= 0.008 and 0.01 <= v["weight_decay"] <= 0.3 and v["opt"] in ("adamw", "sgd")
        assert isinstance(v["batch_size"], int) and 32 <= v["batch_size"] <= 128


@pytest.mark.parametrize("spec, words", [
    ("lr=1..0.1", "LOW must be below HIGH"), ("lr=0..1:log", "log scale needs LOW > 0"),
    ("lr=x1..2", "both bounds are multiples"), ("lr", "expected NAME=LOW..HIGH"),
    ("lerning_rate=1..2", "not a training setting"), ("output=a|b", "where or how the run goes"),
    ("batch_size=16.5..64", "whole number"), ("lr=1..2:sqrt", "log or nothing"),
    ("hflip=yes|no", "not true or false"), ("lr=a..b", "'a' is not a number")])
def test_space_refuses_with_the_reason(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_space([spec])
    with pytest.raises(ValueError, match="given twice"):
        parse_space(["lr=1e-4..1e-2", "lr=1e-4..1e-3"])


def test_refusals_before_any_trial(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["tune", "--holdout", "0", "--output", str(out)]) == 2
    assert "test split" in capsys.readouterr().err
    assert main(["tune", "--smoothing", "0", "--space", "smoothing=x0.5..x2", "--output", str(out)]) == 2
    assert "multiples of it make no range" in capsys.readouterr().err
    assert main(["tune", "--nproc-per-node", "2", "--output", str(out)]) == 2
    assert "same --storage and --study" in capsys.readouterr().err
    assert not out.exists()  # nothing written
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert main(["tune", "--output", str(tmp_path / "mine")] + FAST) == 2
    assert "not a `vitkit tune` folder" in capsys.readouterr().err


def _best_of(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return max(r["val_top1"] for r in rows if "val_top1" in r)


def test_trials_are_runs_on_held_out_images_and_the_same_command_continues(tmp_path, capsys):
    out = tmp_path / "study"
    args = ["tune", "--epochs", "2", "--output", str(out), "--seed", "3", *FAST]
    assert main(args + ["--trials", "2"]) == 0
    text = capsys.readouterr().out
    assert "validating on 142 held-out training images (--holdout 0.1" in text  # never the test split
    study = optuna.load_study(study_name="vitkit", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    for t in study.trials:
        folder = out / f"trial-{t.number:03d}"
        assert t.user_attrs["output"] == str(folder) and (folder / "best" / "model.safetensors").is_file()
        assert t.value == pytest.approx(_best_of(folder))  # the value is what its best/ measured
        cfg = (folder / "config.yaml").read_text()
        assert f"lr: {t.params['lr']}" in cfg and "holdout: 0.1" in cfg
        assert 0.25e-3 <= t.params["lr"] <= 4e-3  # digits' lr 1e-3, x0.25..x4
    best = json.loads((out / "best.json").read_text())
    assert best["val_top1"] == pytest.approx(max(t.value for t in study.trials))
    assert "--holdout 0" in text.splitlines()[-1]  # the final command measures on the test split
    # the same command, more trials: the study continues (one more, numbered on)
    assert main(args + ["--trials", "3"]) == 0
    assert "2 of 3 trials finished" in capsys.readouterr().out
    study = optuna.load_study(study_name="vitkit", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.number for t in study.trials] == [0, 1, 2] and (out / "trial-002" / "best").is_dir()
    # ... and another space in the same study is refused, naming both
    assert main(args + ["--trials", "4", "--space", "lr=1e-4..1e-3"]) == 2
    err = capsys.readouterr().err
    assert "lr=x0.25..x4:log" in err and "lr=0.0001..0.001" in err


def test_a_trial_below_the_median_is_pruned_and_its_run_kept(tmp_path, capsys):
    out = tmp_path / "study"
    out.mkdir()
    storage = f"sqlite:///{out / 'study.db'}"
    study = optuna.create_study(study_name="vitkit", storage=storage, direction="maximize")
    dist = {"lr": optuna.distributions.FloatDistribution(2.5e-4, 4e-3, log=True),
            "weight_decay": optuna.distributions.FloatDistribution(0.01, 0.25, log=True)}
    for _ in range(3):  # three finished trials that scored 99% at every epoch
        study.add_trial(optuna.trial.create_trial(params={"lr": 1e-3, "weight_decay": 0.05}, distributions=dist,
                                                  value=99.0, intermediate_values={e: 99.0 for e in range(1, 6)}))
    study.set_user_attr("space", ["lr=x0.25..x4:log", "weight_decay=x0.2..x5:log"])
    study.set_user_attr("dataset", "digits")
    assert main(["tune", "--epochs", "5", "--trials", "4", "--output", str(out), *FAST]) == 0
    text = capsys.readouterr().out
    t = optuna.load_study(study_name="vitkit", storage=storage).trials[3]
    assert t.state.name == "PRUNED"
    assert sorted(t.intermediate_values) == [1, 2]  # pruned at epoch 2 (not before: n_warmup_steps)
    assert "trial 3 pruned at epoch 2" in text
    folder = out / "trial-003"
    assert (folder / "last" / "model.safetensors").is_file()  # what it ran is kept (and resumable)
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.long
def test_two_processes_share_one_study(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "vitkit", "tune", "--epochs", "2", "--trials", "4", "--output", str(out),
           "--storage", f"sqlite:///{tmp_path / 'shared.db'}", *FAST]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    study = optuna.load_study(study_name="vitkit", storage=f"sqlite:///{tmp_path / 'shared.db'}")
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]  # (a 4th may be pruned at epoch 2)
    assert 4 <= len(done) <= 5  # each process stops once 4 are finished (one may have started its last by then)
    assert len({t.number for t in done}) == len(done)
    assert all(sum(f"trial {t.number}:" in log for log in logs) == 1 for t in done)  # each run by one process
    assert all((out / f"trial-{t.number:03d}" / "last").is_dir() for t in done)


def test_processes_opening_a_new_database_at_once_all_open_it(tmp_path):
    """Found by CI: two `vitkit tune` started together on a new SQLite file; one lost the race to create the tables
    ("table study_system_attributes already exists", an OperationalError) and stopped. Four processes, three rounds,
    each on a fresh file (the race lost about one round in two before)."""
    code = ("import sys, optuna; from vitkit.cli.tune_cmd import _storage; "
            "optuna.create_study(study_name='v', storage=_storage(sys.argv[1]), load_if_exists=True); print('ok')")
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f'race-{round_}.db'}"
        procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(4)]
        logs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, logs
    assert len(optuna.load_study(study_name="v", storage=url).trials) == 0


def test_a_storage_optuna_cannot_open_is_one_line(tmp_path, capsys):
    """Found by trying: SQLAlchemy's own errors (no such dialect, a file it cannot create) ended in a traceback."""
    for url, words in (("foo://bar", "NoSuchModuleError"),
                       (f"sqlite:///{tmp_path}/no/such/dir/x.db", "unable to open database file")):
        assert main(["tune", "--storage", url, "--output", str(tmp_path / "s"), "--trials", "1"] + FAST) == 2
        err = capsys.readouterr().err
        assert f"--storage {url}: Optuna cannot open it" in err and words in err and "Traceback" not in err


def test_a_trial_that_cannot_run_stops_the_study_in_one_line(tmp_path, capsys):
    """A setting every trial fails on (a batch larger than the data): the study stops at the first, saying why,
    without Optuna's traceback; a range of whole multiples that collapses to one number is refused before."""
    out = tmp_path / "s"
    assert main(["tune", "--space", "batch_size=100000..200000", "--output", str(out), "--trials", "3",
                 "--epochs", "1"] + FAST) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("vitkit tune: error: ") and "fewer than one global batch" in captured.err
    study = optuna.load_study(study_name="vitkit", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"]
    assert main(["tune", "--semi", "fixmatch", "--train-fraction", "0.5", "--space", "unlabeled_ratio=x0.5..x1.4:log",
                 "--output", str(tmp_path / "t")] + FAST) == 2
    assert "so the range is 1..1, one whole number" in capsys.readouterr().err


def test_a_timeout_starts_no_trial_after_it(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["tune", "--timeout", "0.001", "--trials", "5", "--epochs", "1", "--output", str(out)] + FAST) == 0
    study = optuna.load_study(study_name="vitkit", storage=f"sqlite:///{out / 'study.db'}")
    assert len(study.trials) == 1  # the first started before 0.06 s were up; none after it
    assert main(["tune", "--timeout", "0", "--output", str(tmp_path / "t")]) == 2
    assert "--timeout 0: minutes, more than 0" in capsys.readouterr().err
