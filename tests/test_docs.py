"""README.md and the documentation site: every relative link and anchor resolves, README stays a front page."""

import re
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs' ``toc`` extension (and, for these headings, GitHub) writes it."""
    text = unicodedata.normalize("NFKD", re.sub(r"`|\*\*", "", heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^\1```", flags=re.S | re.M)  # a fenced block, also indented in a tab


def prose(path: Path) -> str:
    """The file without its fenced code blocks (a ``# comment`` there is no heading, a ``](x)`` no link)."""
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), flags=re.M)}


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


def dead_links(pages: list[Path]) -> list[str]:
    """``page: target (why)`` for each relative link whose file or heading does not exist."""
    dead = []
    for page in pages:
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                dead.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{page.name}: {target} (no such heading)")
    return dead


def test_every_relative_link_and_anchor_resolves():
    dead = dead_links(PAGES)
    assert not dead, "\n".join(dead)
    assert sum(len(links(p)) for p in PAGES) > 50  # the check saw the links (a broken pattern would pass anything)


def test_the_checker_finds_a_dead_link_and_a_dead_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section (with `code`)\n\n[x](page.md#a-section-with-code) [y](#nothing) "
                    "[z](missing.md)\n\n```bash\n# not a heading [w](nowhere.md)\n```\n")
    assert anchors(page) == {"title", "a-section-with-code"}
    assert links(page) == ["page.md#a-section-with-code", "#nothing", "missing.md"]
    assert dead_links([page]) == ["page.md: #nothing (no such heading)", "page.md: missing.md (no such file)"]


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's ``nav:``, sections walked (``- Title: page.md`` at any depth)."""
    return re.findall(r"^\s+- (?:\"[^\"]*\"|[^:\"]+): (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)


def test_readme_is_a_front_page_with_both_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert re.search(r"^python -m pip install -e \. && ", text, flags=re.M)  # .ci/run reads both from README
    assert re.search(r'^python -m pip install -e "\.\[test\]" && ', text, flags=re.M)
    assert sorted(nav_pages()) == sorted(p.name for p in DOCS)  # every page is in the site's navigation


# Every command in README's and the docs' shell blocks, and every output line they quote, with what the suite does
# with it: "run" (an error line: the command that prints it, run here), "checked" (its settings checked as `train`
# checks them before any work, not trained: why), "test" (a named test runs it, perhaps smaller), "ci" (.ci/run runs
# it, the text says where) or "not run" (why). docs/testing.md lists the checked and not-run ones.
COMMANDS = {
    # set-up, README and getting-started
    "python3 -m venv .venv && . .venv/bin/activate": ("ci", "python3 -m venv --clear .venv"),
    "python -m pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu":
        ("not run", "CI installs torch from its own package registry, without download.pytorch.org"),
    "python -m pip install -e . && YOLO_OFFLINE=1 yolo-ckpt train checkpoint_stages=all": ("ci", "$main_job epochs=1"),
    'python -m pip install -e ".[test]" && OMP_NUM_THREADS=1 YOLO_OFFLINE=1 python -m pytest -q -n 2 --dist worksteal':
        ("ci", '"$tests"'),
    "git clone <this repository> yolo-ckpt && cd yolo-ckpt": ("not run", "CI runs .ci/run in a fresh clone of main"),
    "ruff check .": ("ci", "ruff check ."),
    # the tour and choosing a plan
    "yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=8 checkpoint_stages=[2,3]":
        ("checked", "COCO at 1280 px"),
    "yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 checkpoint_stages=all checkpoint_layers=head":
        ("checked", "COCO at 1280 px"),
    "yolo-ckpt train data=dota.yaml model=yolo11n-obb.yaml imgsz=1024 checkpoint_stages=all checkpoint_mode=selective":
        ("checked", "DOTA at 1024 px"),
    "yolo-ckpt train cfg=cfg/aerial_1280.yaml data=my_tiles.yaml": ("checked", "the user's own tiles"),
    "yolo-ckpt train resume model=runs/detect/train/weights/last.pt":
        ("test", "tests/test_trainer.py::test_resume_continues_with_the_same_stages"),
    "yolo-ckpt train model=yolo11n-obb.yaml data=dota.yaml imgsz=1024 checkpoint_stages=all":
        ("checked", "DOTA at 1024 px"),
    "yolo-ckpt train model=rtdetr-l.yaml data=coco.yaml checkpoint_stages=all checkpoint_layers=head":
        ("checked", "COCO"),
    "python -m yolo_ckpt train ...":
        ("test", "tests/test_cli.py::test_unknown_key_is_one_line_naming_the_closest_key_as_yolo_finds_it"),
    "yolo-ckpt help": ("test", "tests/test_cli.py::test_help_lists_our_keys_and_profile_then_ultralytics_help"),
    "yolo-ckpt version": ("test", "tests/test_cli.py::test_version_prints_ours_and_ultralytics"),
    "yolo-ckpt checks":
        ("test", "tests/test_cli.py::test_checks_says_whether_torch_and_torchvision_agree_then_runs_yolo_checks"),
    # the error lines quoted, each with the command that prints it
    "yolo-ckpt: error: checkpoint_stages=7: yolo11n.yaml has no stage 7. Valid: a list of distinct stage numbers "
    "from {1, 2, 3, 4, 5}, a single stage, 'all', 'auto' (with memory_budget or CUDA), 'least' (the plan that keeps "
    "the least), or [] for off.":
        ("run", "train checkpoint_stages=7"),
    "yolo-ckpt: error: task='panoptic' is not a task yolo-ckpt trains. Valid: detect, segment, semantic, depth, pose, "
    "obb, classify.": ("run", "train task=panoptic"),
    "yolo-ckpt: error: task=semantic: yolo11n.yaml is a detect model (its output layer trains detect). Valid: a "
    "semantic model such as yolo26n-sem.yaml, or task=detect.": ("run", "train task=semantic model=yolo11n.yaml"),
    "yolo-ckpt: error: checkpoint_loss=exact: task=semantic has no loss region yolo-ckpt recomputes exact. Valid: "
    "checkpoint_loss=none; exact with task detect/segment/pose/obb; chunked with task "
    "detect/segment/semantic/depth/pose/obb.": ("run", "train checkpoint_loss=exact semantic"),
    "yolo-ckpt train data=dense_tiles.yaml model=yolo11n-seg.yaml imgsz=1024 checkpoint_stages=all "
    "checkpoint_layers=head checkpoint_loss=exact": ("checked", "the user's own tiles at 1024 px"),
    "yolo-ckpt train data=synthetic_dense model=yolo11n-seg.yaml imgsz=1024 batch=2 checkpoint_stages=all "
    "checkpoint_layers=head checkpoint_loss=chunked":
        ("checked", "1024 px epochs of instance masks take minutes on CPU"),
    "yolo-ckpt train data=synthetic_dense model=yolo11n.yaml imgsz=1024 batch=2 checkpoint_stages=[1,2] "
    "checkpoint_layers=\"['2.*','3-4','5-6','7-10','13','16','17','19','20','22','23.*']\"":
        ("checked", "1024 px epochs take minutes on CPU"),
    # planning for a GPU
    "yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=8 checkpoint_stages=auto memory_budget=24GB":
        ("checked", "COCO at 1280 px"),
    "yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=-1 checkpoint_stages=all memory_budget=24GB":
        ("checked", "COCO at 1280 px"),
    "yolo-ckpt train data=coco.yaml model=yolo11n.yaml imgsz=640 batch=4 compile=True checkpoint_stages=auto "
    "memory_budget=2GB": ("checked", "COCO at 640 px, twelve inductor compiles"),
    "python benchmarks/ultralytics_tests.py":
        ("test", "tests/test_ultralytics_suite.py::test_ultralytics_training_tests_pass_with_our_trainers"),
    "python benchmarks/compiled_memory.py --imgsz 640 --batch 4 --plan-budgets":
        ("test", "tests/test_compile.py::test_profiler_allocation_peak_is_the_tracker_peak_on_eager_steps_and_"
                 "measures_compiled_ones"),
    "yolo-ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=-1 checkpoint_stages=auto":
        ("not run", "auto without memory_budget plans for a CUDA device's free memory"),
    "yolo-ckpt profile model=yolo11n.yaml imgsz=640 batch=4 memory_budget=24GB":
        ("test", "tests/test_profiler.py::test_profile_command_on_a_simulated_device"),
    "yolo-ckpt train device=cpu simulate_gpu=925MB checkpoint_stages=auto imgsz=640 batch=4":
        ("checked", "auto's planning and the demo's epochs at 640 px take minutes on CPU"),
    # recipes and tasks: fine-tuning from .pt weights, checked on the model's .yaml (the same layers and stages;
    # the weights are a download)
    "yolo-ckpt train model=yolo11s.pt data=my_tiles.yaml imgsz=1280 batch=8 checkpoint_stages=[2,3]":
        ("checked", "the user's own tiles at 1280 px, yolo11s.pt weights"),
    "yolo-ckpt train model=yolo11s.pt data=my_tiles.yaml imgsz=1280 batch=8 checkpoint_stages=auto memory_budget=24GB":
        ("checked", "the user's own tiles at 1280 px, yolo11s.pt weights"),
    "yolo-ckpt train model=yolo11n-seg.pt data=dense_tiles.yaml imgsz=1024 batch=2 checkpoint_stages=all "
    "checkpoint_layers=head checkpoint_loss=chunked":
        ("checked", "the user's own tiles at 1024 px, yolo11n-seg.pt weights"),
    "yolo-ckpt train model=yolo11n-seg.pt data=my_masks.yaml imgsz=1280 checkpoint_stages=all checkpoint_layers=head":
        ("checked", "the user's own masks at 1280 px, yolo11n-seg.pt weights"),
    "yolo-ckpt train cfg=cfg/medical_2048.yaml":
        ("test", "tests/test_medical.py::test_cli_trains_the_recipe_on_the_grayscale_variant"),
    "yolo-ckpt train cfg=cfg/medical_2048.yaml data=my_scans.yaml": ("checked", "the user's own scans"),
    "yolo-ckpt train cfg=cfg/medical_2048.yaml imgsz=128 epochs=1": ("checked", "a real epoch on CPU"),
    "yolo-ckpt train cfg=cfg/medical_semantic_2048.yaml": ("checked", "2048 px, batch 8"),
    "yolo-ckpt train cfg=cfg/aerial_semantic_1024.yaml": ("checked", "1024 px, batch 32"),
    "yolo-ckpt train cfg=cfg/medical_semantic_2048.yaml data=my_masks.yaml": ("checked", "the user's own masks"),
    # multi-node: tests/test_torchrun.py launches the same entry point with torchrun on one CPU node
    "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$MASTER:29500 --rdzv-id=yolo1 -m "
    "yolo_ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=64 checkpoint_stages=[2,3]":
        ("not run", "two nodes of 8 GPUs; tests/test_torchrun.py launches torchrun on one CPU node"),
    'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': ("not run", "SLURM"),
    "export MASTER_PORT=29500": ("not run", "SLURM"),
    'srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=8 --rdzv-backend=c10d '
    '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" -m yolo_ckpt train data=coco.yaml '
    "model=yolo11s.yaml imgsz=1280 batch=64 checkpoint_stages=auto": ("not run", "SLURM, GPU nodes"),
    'torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node=8 --master-addr="$MASTER_ADDR" '
    '--master-port="$MASTER_PORT" -m yolo_ckpt train data=coco.yaml model=yolo11s.yaml imgsz=1280 batch=64 '
    "checkpoint_stages=[2,3]": ("not run", "Kubernetes, GPU nodes"),
}


def documented_commands(path: Path) -> list[str]:
    """The commands of ``path``'s shell blocks (continuations joined, trailing comments cut) and the ``yolo-ckpt:
    error:`` lines its plain blocks quote; other output (log excerpts) and Python blocks are not commands."""
    found = []
    for indent, lang, body in FENCE.findall(path.read_text()):
        body = re.sub(rf"^{indent}", "", body, flags=re.M)  # a block inside a tab (=== "CLI") is indented
        if lang == "bash":
            for line in re.sub(r"\\\n\s*", "", body).splitlines():
                if (command := re.sub(r"\s+#\s.*$", "", line).strip()) and not command.startswith("#"):
                    found.append(command)
        elif not lang:
            found += [line for line in body.splitlines() if line.startswith("yolo-ckpt: error: ")]
    return found


def test_every_documented_command_is_run_checked_or_listed_as_not_run(capsys):
    from yolo_ckpt.integration.cli import main, parse_train_args
    from yolo_ckpt.integration.settings import check_settings
    from yolo_ckpt.regions.families import DEFAULT_MODELS

    documented = {c for page in PAGES for c in documented_commands(page)}
    assert not documented - COMMANDS.keys(), f"not classified in COMMANDS: {sorted(documented - COMMANDS.keys())}"
    assert not COMMANDS.keys() - documented, f"no longer documented: {sorted(COMMANDS.keys() - documented)}"
    ci, listed = (ROOT / ".ci" / "run").read_text(), (ROOT / "docs" / "testing.md").read_text()
    for command, (kind, detail) in COMMANDS.items():
        if kind == "run":  # the line the docs quote is the line the command prints, and it stops with exit 2
            assert main(detail.split()) == 2, command
            assert capsys.readouterr().err.strip() == command
        elif kind == "checked":  # what `yolo-ckpt train` checks before it builds the model or writes a file
            args = parse_train_args(command.split()[1:])
            model = args.get("model") or DEFAULT_MODELS[args.get("task") or "detect"]
            check_settings(re.sub(r"\.pt$", ".yaml", model), args)  # a .pt's stages are its .yaml's
        elif kind == "test":
            file, name = detail.split("::")
            assert f"def {name}(" in (ROOT / file).read_text(), detail
        elif kind == "ci":
            assert detail in ci, f"{command}: .ci/run has no {detail!r}"
        else:
            assert kind == "not run", command
        if kind in ("checked", "not run"):
            assert f"`{command}`" in listed, f"docs/testing.md does not list {command!r} as not run"


def test_the_command_reader_joins_continuations_and_cuts_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nyolo-ckpt train a=1 \\\n  b=2   # why\n# a comment\n```\n\n```\nyolo-ckpt: error: x\n"
                    "checkpoint: a log line\n```\n\n```python\nYOLO('a')\n```\n\n=== \"CLI\"\n\n    ```bash\n"
                    "    yolo-ckpt train c=3\n    ```\n")
    assert documented_commands(page) == ["yolo-ckpt train a=1 b=2", "yolo-ckpt: error: x", "yolo-ckpt train c=3"]


def benchmark_commands() -> set[str]:
    """Every ``python benchmarks/...`` command the pages show, in code spans (wrapped lines joined) or blocks."""
    text = "\n".join(p.read_text() for p in PAGES)
    return {" ".join(c.split()) for c in re.findall(r"`(python benchmarks/[^`]+)`|^(python benchmarks/.*)$", text,
                                                      flags=re.M) for c in c if c}


def test_every_documented_benchmark_command_names_a_script_and_flags_it_has(capsys, monkeypatch):
    """The figures' commands (run at full size by hand, at small sizes by tests/test_benchmarks.py) do not drift: each
    script exists, and each ``--flag`` shown is one its ``--help`` lists; a script without options is shown bare."""
    import runpy

    commands = benchmark_commands()
    assert len(commands) >= 20  # the reader saw them
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    for script in sorted({c.split()[1] for c in commands}):
        source = (ROOT / script).read_text()
        flags = {f.split("=")[0] for c in commands if c.split()[1] == script for f in c.split() if f.startswith("--")}
        if "argparse" not in source:
            assert not flags and all(c == f"python {script}" for c in commands if c.split()[1] == script), script
            continue
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        shown = capsys.readouterr().out
        assert stop.value.code == 0 and not (missing := {f for f in flags if f not in shown}), f"{script}: {missing}"


# The site reads in one sitting: a page under ~1,500 words, a section (the text under one ``##`` heading, its ``###``
# included; the text before the first ``##`` counts as one) under ~600, code blocks not counted; "Choose a plan"
# opens with its decision table; the keys' table is generated from cfg/default.yaml at every build.
PAGE_WORDS, SECTION_WORDS = 1500, 600
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import keys as keys_hook  # noqa: E402  (docs/hooks/keys.py, the mkdocs hook of mkdocs.yml)


def built_markdown(page: Path) -> str:
    """The page's markdown as the site builds it: the keys' marker replaced by the generated tables."""
    return keys_hook.on_page_markdown(page.read_text(), None, None, None)


def word_counts(markdown: str) -> tuple[int, dict[str, int]]:
    """Words of the page, and of each section by its heading, fenced code left out."""
    text = FENCE.sub("", markdown)
    sections = re.split(r"^## ", text, flags=re.M)
    return len(text.split()), {s.splitlines()[0] if s.strip() else "": len(s.split()) for s in sections}


def test_every_page_and_section_of_the_site_is_short_enough_to_read_in_one_sitting():
    pages = nav_pages()
    assert "plans.md" in pages and len(pages) >= 20
    too_long = []
    for name in pages:
        words, sections = word_counts(built_markdown(ROOT / "docs" / name))
        too_long += [f"{name}: {words} words"] if words > PAGE_WORDS else []
        too_long += [f"{name}, {head!r}: {n} words" for head, n in sections.items() if n > SECTION_WORDS]
    assert not too_long, "\n".join(too_long)


def test_the_word_counter_leaves_out_code_and_splits_at_second_level_headings():
    words, sections = word_counts("# T\n\none two\n\n## A\n\nthree\n\n### B\n\nfour\n\n```bash\nx y z\n```\n")
    assert words == 10 and sections == {"# T": 4, "A": 5}  # "# T one two" / "A three ### B four"


def test_choose_a_plan_opens_with_its_decision_table():
    lines = [line for line in (ROOT / "docs" / "plans.md").read_text().splitlines() if line.strip()]
    assert lines[0] == "# Choose a plan" and lines[1].startswith("| your situation |"), lines[:2]
    table = [line for line in lines[1:] if line.startswith("|")][: len(lines)]
    rows = "\n".join(table[2 : next(i for i, line in enumerate(lines[1:]) if not line.startswith("|"))])
    for situation, keys in [("Batch 1 still runs out", "checkpoint_stages=least"), ("larger batch", "batch=-1"),
                            ("larger imgsz", "checkpoint_stages=[2,3]"), ("Dense scenes", "checkpoint_loss="),
                            ("Semantic or depth", "checkpoint_loss=chunked"), ("let it choose", "auto"),
                            ("Several GPUs", "torchrun")]:
        assert any(situation in row and keys in row for row in rows.splitlines()), situation


def test_the_keys_table_is_generated_from_cfg_default_yaml(tmp_path):
    built = built_markdown(ROOT / "docs" / "plans.md")
    assert keys_hook.MARKER not in built
    listed = re.findall(r"^([a-z_]+):", (ROOT / "cfg" / "default.yaml").read_text(), flags=re.M)
    assert len(listed) >= 8
    for key in listed:
        assert re.search(rf"^\| `{key}` \|", built, flags=re.M), f"{key} of cfg/default.yaml is not in Choose a plan"
    # a key added to the file appears with its default and comment, a continued comment joined to it
    groups = keys_hook.read_keys("# Things ----\nnew_key: 7 # (int) first line\n  # second | line\n")
    assert groups == [("Things", [("new_key", "7", "(int) first line second | line")])]
    assert "| `new_key` | `7` | *int*: first line second &#124; line |" in keys_hook.keys_markdown(
        "# Things ----\nnew_key: 7 # (int) first line\n  # second | line\n")
    assert "hooks/keys.py" in (ROOT / "mkdocs.yml").read_text()
