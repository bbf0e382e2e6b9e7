"""``vitkit push RUN --repo USER/NAME``: a run's weights on the Hugging Face Hub, loadable by vitkit, timm and
transformers, with a model card saying how they were trained and what they measured.

The repository it writes: ``model.safetensors`` + ``config.json`` at the top (vitkit's folder; the same
``config.json`` carries timm's Hub fields, and the weights have timm's names, so ``timm.create_model("hf-hub:...")``
reads them too), ``hf/`` (transformers' layout), ``model.onnx``, ``README.md`` (the card), ``curves.png`` and
``training/`` (the run's config, plan and metrics). The upload is huggingface_hub's ``upload_folder`` (its login,
``HF_TOKEN``, ``HF_ENDPOINT``), one commit; the files are written first, so ``--out DIR --dry-run`` shows them
without uploading."""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

FORMATS = ("hf", "onnx", "jax")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a run folder (vitkit train --output) or a checkpoint folder in it")
    p.add_argument("--repo", required=True, metavar="USER/NAME", help="the Hub repository (created if missing)")
    p.add_argument("--which", choices=("best", "last"), default="best",
                   help="the run's best/ (best validation top-1, the default) or last/ weights")
    p.add_argument("--formats", default="auto", metavar="LIST",
                   help="besides vitkit's (and timm's) safetensors at the top: a comma list of hf, onnx, jax; auto "
                        "(the default): hf and onnx where they apply, each skipped with a line saying why where not")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", default=None, metavar="BRANCH", help="push to this branch (created from main)")
    p.add_argument("--message", default=None, help="the commit message")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the repository's files here (kept); default: a temporary folder")
    p.add_argument("--dry-run", action="store_true", help="write the files (--out DIR) and the card, upload nothing")


def checkpoint_of(run: Path, which: str) -> tuple[Path, Path | None, str]:
    """(checkpoint folder, run folder or None, which) for RUN: a run folder or a checkpoint folder."""
    if not run.exists():
        raise FileNotFoundError(f"{run} not found")
    for name in (which, "last" if which == "best" else "best"):
        if (run / name / "config.json").is_file():
            if name != which:
                print(f"{run} has no {which}/: pushing {name}/")
            return run / name, run, name
    if (run / "config.json").is_file():
        parent = run.parent if (run.parent / "config.yaml").is_file() else None
        return run, parent, run.name if run.name in ("best", "last") else which
    raise ValueError(f"{run}: neither a run folder (best/ or last/ with config.json) nor a checkpoint folder "
                     "(config.json + model.safetensors)")


def run_facts(ckpt: Path, run: Path | None, which: str):  # type: ignore[no-untyped-def]
    """What the run folder says about the weights (interop.card.RunFacts); a file that does not read as what it
    should be is left out of the card, with a line saying so (the weights are what is pushed)."""
    import yaml

    from ..interop.card import RunFacts

    def mapping(path: Path, parse: Any, what: str) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            value = parse(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError) as e:
            print(f"{path}: not read ({type(e).__name__}); the card goes without {what}")
            return {}
        if not isinstance(value, dict):
            print(f"{path}: not a mapping; the card goes without {what}")
            return {}
        return value

    f = RunFacts(which=which)
    f.evaluated = mapping(ckpt / "eval" / "eval.json", json.loads, "the evaluation")
    if run is None:
        return f
    f.config = mapping(run / "config.yaml", yaml.safe_load, "the training settings")
    f.plan = mapping(run / "plan.json", json.loads, "the plan")
    lines = []
    if (p := run / "metrics.jsonl").is_file():
        for line in p.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:  # a line cut by a kill: the others still count
                continue
    scored = [m for m in lines if isinstance(m, dict) and isinstance(m.get("val_top1"), (int, float))]
    if scored:
        f.last = scored[-1]
        f.best = max(scored, key=lambda m: m["val_top1"]) if which == "best" else scored[-1]
    f.curves = (run / "curves.png").is_file()
    return f


def wanted_formats(text: str) -> tuple[list[str], bool]:
    """(formats, asked): ``auto`` is hf and onnx where they apply; a list given is refused where one does not."""
    if text == "auto":
        from importlib.util import find_spec

        return ["hf"] + (["onnx"] if find_spec("onnxruntime") and find_spec("onnx") else []), False
    asked = [f.strip() for f in text.split(",") if f.strip()]
    if bad := [f for f in asked if f not in FORMATS]:
        raise ValueError(f"--formats {text}: {', '.join(bad)} unknown; choose from {', '.join(FORMATS)} (vitkit's "
                         "safetensors is always written)")
    return asked, True


def stage(ckpt: Path, run: Path | None, which: str, repo_id: str, out: Path, formats: list[str],
          asked: bool) -> list[str]:
    """Write the repository's files into ``out``; returns what they are, in order."""
    from ..data.preprocess import preprocessing_of
    from ..interop import load
    from ..interop.card import model_card, timm_hub_config, timm_refusal
    from ..model.serialization import save_pretrained
    from .export_cmd import write_weights

    model = load(ckpt).eval()
    pre = preprocessing_of(model)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)  # vitkit's folder; its weights carry timm's names already (interop/timm.py)
    files = {"model.safetensors": "the weights (vitkit's and timm's names are the same)"}
    timm_why_not = timm_refusal(model.config)
    meta = json.loads((out / "config.json").read_text())
    if not timm_why_not:
        meta.update(timm_hub_config(model.config, pre))  # one config.json that vitkit and timm both read
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    files["config.json"] = "the model and its preprocessing (vitkit's keys" + ("" if timm_why_not else
                                                                                  "; timm's Hub keys beside them") + ")"
    hf_why_not = "not asked for (--formats)"
    where = {"hf": out / "hf", "onnx": out / "model.onnx", "jax": out / "model.npz"}
    what = {"hf": "transformers' ViTForImageClassification folder", "onnx": "ONNX (onnxruntime, fp32)",
            "jax": "the official JAX checkpoint layout (.npz)"}
    for fmt in formats:
        try:
            if line := write_weights(model, fmt, where[fmt]):
                print(f"{fmt}: {line}")
        except (ValueError, ImportError) as e:
            if asked:
                raise ValueError(f"--formats {fmt}: {e}") from e
            print(f"skipped {fmt}: {e}")
            if fmt == "hf":
                hf_why_not = str(e)
            continue
        if fmt == "hf":
            hf_why_not = None
        files[f"{where[fmt].name}/" if fmt == "hf" else where[fmt].name] = what[fmt]
    facts = run_facts(ckpt, run, which)
    if facts.curves:
        shutil.copyfile(run / "curves.png", out / "curves.png")  # type: ignore[operator]
        files["curves.png"] = "the training curves"
    if run is not None:
        (out / "training").mkdir(exist_ok=True)
        for name in ("config.yaml", "plan.json", "metrics.jsonl"):
            if (run / name).is_file():
                shutil.copyfile(run / name, out / "training" / name)
                files[f"training/{name}"] = {"config.yaml": "the run's whole configuration",
                                             "plan.json": "what the planner measured and chose on the machine",
                                             "metrics.jsonl": "every epoch's losses and accuracies"}[name]
    files["README.md"] = "this card"
    (out / "README.md").write_text(model_card(repo_id, model, pre, facts, files, timm_why_not, hf_why_not))
    return list(files)


def upload(out: Path, repo_id: str, private: bool, revision: str | None, message: str) -> str:
    """One commit of ``out`` to ``repo_id`` (created if missing); returns the commit's URL."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=out, repo_id=repo_id, revision=revision, commit_message=message)
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        why = {401: "not logged in, or the token cannot write there: `hf auth login` or set HF_TOKEN",
               403: "the token cannot write to this repository (a read token, or another user's namespace)"}.get(
            status, str(e).splitlines()[0])
        raise OSError(f"the Hub refused the push to {repo_id} (HTTP {status}): {why}") from None
    except Exception as e:  # noqa: BLE001 - httpx's transport errors are not OSErrors
        transport = type(e).__module__.split(".")[0].rstrip("0123456789") in ("httpx", "httpcore", "requests", "urllib")
        if not (isinstance(e, OSError) or transport):
            raise
        raise OSError(f"could not reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {e}); nothing was "
                      "pushed") from None
    return str(info.commit_url)


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # (utils: old and new huggingface_hub)

    from .import_cmd import refuse_overwrite

    try:
        validate_repo_id(args.repo)
    except HFValidationError as e:
        raise ValueError(f"--repo {args.repo}: not a Hub repository id USER/NAME ({e})") from None
    if args.dry_run and not args.out:
        raise ValueError("--dry-run writes the files without uploading them: give --out DIR to keep them")
    formats, asked = wanted_formats(args.formats)
    ckpt, run_dir, which = checkpoint_of(Path(args.run), args.which)
    if args.out:
        refuse_overwrite(Path(args.out))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vitkit-push-"))
    try:
        files = stage(ckpt, run_dir, which, args.repo, out, formats, asked)
        print(f"wrote {len(files)} files for {args.repo}" + (f" in {out}" if args.out else "") + f": {', '.join(files)}")
        if args.dry_run:
            print("--dry-run: nothing uploaded; the card is README.md")
            return 0
        url = upload(out, args.repo, args.private, args.revision,
                     args.message or f"vitkit push: {ckpt} ({which})")
        print(f"pushed {args.repo}: {url}")
        return 0
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
