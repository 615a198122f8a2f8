"""What the results reader and the targets make of folders that no run of today's suite leaves: runs that are not
whole (an older version's append cut between the two files), files a spreadsheet saved with a byte order mark, a
row of a schema version its header is not, a PREFIX that is a symbolic link loop, and paths full of spaces,
quotes and unicode. Each is read, or refused in one line with a non-zero exit; no file is ever changed by it.
Folders are written by the suite's own writer (Utils.results.store), never by a training run."""
import codecs
import contextlib
import io
import os

import pytest

from conftest import (add_run, clean_env, make, read_csv, rewrite_as_version_1, run_main, step_rows, summary_table,
                      two_runs)
from Utils.report import compare
from Utils.results.read import load
from Utils.results.schema import RUN_COLUMNS, RUN_SCHEMA, SCHEMA_VERSION, STEP_COLUMNS, STEPS_FILE, headers
from Utils.results.store import ResultsError, append_rows, check_prefix
from Utils.suite.__main__ import main as suite

BOM = codecs.BOM_UTF8
def snapshot(prefix):
    """{name: bytes} of prefix's CSV files: what a reader, or a refusal, must never change."""
    return {n: open(os.path.join(prefix, n), "rb").read() for n in sorted(os.listdir(prefix))
            if n.endswith(".csv")}


def errors(text):
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def warnings(text):
    return [ln for ln in text.splitlines() if ln.startswith("warning:")]


# --- runs that are not whole ---------------------------------------------------------------------------------

def lone_steps(prefix, run_id="lost-1", rung="bf16", n=3):
    """Step rows of a run whose run row never arrived, as an older version's append cut between the two files
    left them: written to results.csv alone, by the suite's writer."""
    append_rows(prefix, STEPS_FILE, STEP_COLUMNS, step_rows(run_id, rung, [30.0] * (n - 1)))


def test_make_plots_names_step_rows_without_their_run_and_draws_the_whole_runs_only(tmp_path):
    prefix = two_runs(str(tmp_path / "out"))
    lone_steps(prefix)
    before = snapshot(prefix)
    done = make(["plots", f"PREFIX={prefix}"], clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert warnings(done.stderr) == [
        f"warning: {prefix}/results.csv: 3 step rows of run lost-1 (bf16) have no row in runs.csv (an append of an "
        f"earlier version cut between the two files): left out of the charts, the summary and comparisons; the file "
        f"is left as it is"]
    assert list(summary_table(prefix)) == ["baseline", "tf32"]
    assert summary_table(prefix)["tf32"]["speedup"] == "2.00x"
    assert all(os.path.getsize(os.path.join(prefix, n)) > 0 for n in ("speedup.png", "loss.png", "summary.md"))
    assert snapshot(prefix) == before


def test_an_ok_run_without_step_rows_is_named_and_left_out_and_a_skipped_one_is_whole(tmp_path):
    prefix = two_runs(str(tmp_path))
    add_run(prefix, "bf16", ms=(), run_id="bf16-no-steps")       # ok, yet its steps never arrived
    add_run(prefix, "8bit", ms=(), status="skipped")             # a skip measures nothing: whole without steps
    before = snapshot(prefix)
    rc, out, err = run_main(prefix)
    assert rc == 0, err
    assert warnings(err) == [f"warning: {prefix}/runs.csv: run bf16-no-steps (bf16) is recorded ok with no step rows "
                             f"in results.csv: left out of the charts, the summary and comparisons; the file is left "
                             f"as it is"]
    rows = summary_table(prefix)
    assert "bf16" not in rows and rows["8bit"]["status"] == "skipped"
    assert snapshot(prefix) == before


def test_every_partial_run_is_named_once_with_its_rows(tmp_path):
    prefix = two_runs(str(tmp_path))
    lone_steps(prefix, "lost-1", "bf16", 3)
    lone_steps(prefix, "lost-2", "flash", 5)
    add_run(prefix, "fused", ms=(), run_id="fused-no-steps")
    lines = []
    steps_df, runs_df = load(prefix, warn=lines.append)
    assert [ln.split(": ", 2)[2].split(":")[0] for ln in lines] == [
        "3 step rows of run lost-1 (bf16) have no row in runs.csv (an append of an earlier version cut between the "
        "two files)",
        "5 step rows of run lost-2 (flash) have no row in runs.csv (an append of an earlier version cut between the "
        "two files)",
        "run fused-no-steps (fused) is recorded ok with no step rows in results.csv"]
    assert set(steps_df["run_id"]) == {"baseline-ok", "tf32-ok"} and list(steps_df.index) == list(range(8))
    assert list(runs_df["run_id"]) == ["baseline-ok", "tf32-ok"] and list(runs_df.index) == [0, 1]


def test_a_folder_of_partial_runs_only_is_refused_after_naming_them(tmp_path):
    prefix = str(tmp_path)
    add_run(prefix, "baseline", ms=(), run_id="a")
    lone_steps(prefix, "b", "baseline")
    rc, out, err = run_main(prefix)
    assert rc == 2 and len(warnings(err)) == 2
    assert errors(err) == [f"error: {prefix}/runs.csv records no whole run (the partial ones are named above): run a "
                           f"rung first, e.g. make baseline STEPS=20 BATCH_SIZE=8 PREFIX={prefix}"]
    assert not os.path.exists(os.path.join(prefix, "summary.md"))


def test_compare_leaves_a_folders_partial_runs_out_and_names_them(tmp_path):
    a, b = two_runs(str(tmp_path / "a")), two_runs(str(tmp_path / "b"))
    lone_steps(b, "lost-1", "fused")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = compare.main(["--out", str(tmp_path), a, b])
    assert rc == 0, err.getvalue()
    assert [w.split(": ")[0:2] for w in warnings(err.getvalue())] == [["warning", f"{b}/results.csv"]]
    assert "| fused" not in out.getvalue() and "| tf32" in out.getvalue()


# --- a spreadsheet's byte order mark -------------------------------------------------------------------------

def as_saved_by_a_spreadsheet(prefix, crlf):
    """Each results file with a UTF-8 byte order mark in front, and CRLF line ends where crlf (Excel's "CSV UTF-8")."""
    for name in ("results.csv", "runs.csv"):
        path = os.path.join(prefix, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(BOM + (data.replace(b"\n", b"\r\n") if crlf else data))


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
def test_a_file_saved_with_a_byte_order_mark_is_read_and_appended_to(tmp_path, crlf):
    plain, marked = two_runs(str(tmp_path / "plain")), two_runs(str(tmp_path / "marked"))
    as_saved_by_a_spreadsheet(marked, crlf)
    for read, expected in zip(load(marked), load(plain)):
        assert read.equals(expected)
    check_prefix(marked)   # a run into it is not refused
    before = snapshot(marked)
    add_run(marked, "bf16", (25.0, 25.5, 24.5))
    for name in ("results.csv", "runs.csv"):
        data = open(os.path.join(marked, name), "rb").read()
        assert data.startswith(before[name]) and data.count(BOM) == 1   # only appended to, the mark kept in front
        assert data.count(b"\r\n") == (data.count(b"\n") if crlf else 0)
    rc, out, err = run_main(marked)
    assert rc == 0 and not warnings(err) and not errors(err), err
    assert summary_table(marked)["bf16"]["speedup"] == "4.00x"


def test_an_earlier_versions_file_with_a_byte_order_mark_is_widened_behind_it(tmp_path):
    prefix = two_runs(str(tmp_path))
    rewrite_as_version_1(prefix)
    as_saved_by_a_spreadsheet(prefix, crlf=False)
    add_run(prefix, "bf16", (25.0, 25.5, 24.5))
    for name, columns in (("results.csv", STEP_COLUMNS), ("runs.csv", RUN_COLUMNS)):
        data = open(os.path.join(prefix, name), "rb").read()
        assert data.startswith(BOM + (",".join(columns) + "\n").encode()) and data.count(BOM) == 1
    assert list(load(prefix)[1]["optimization"]) == ["baseline", "tf32", "bf16"]


def test_a_spreadsheets_save_of_an_empty_file_is_an_empty_file(tmp_path):
    prefix = str(tmp_path)
    for name in ("results.csv", "runs.csv"):
        (tmp_path / name).write_bytes(BOM)
    rc, _, err = run_main(prefix)
    assert rc == 2 and errors(err) == [f"error: {prefix}/results.csv is empty: run a rung first, e.g. make baseline "
                                       f"STEPS=20 BATCH_SIZE=8 PREFIX={prefix}"]
    add_run(prefix, "baseline")
    assert (tmp_path / "runs.csv").read_bytes().startswith(BOM + b"run_id,optimization,status,")
    assert list(load(prefix)[1]["run_id"]) == ["baseline-ok"]


# --- a row whose schema version is not its header's ----------------------------------------------------------

def set_version(path, line, version):
    """Give the row at `line` (1: the header) the schema_version `version`, by hand."""
    with open(path, newline="") as f:
        lines = f.read().split("\n")
    cells = lines[line - 1].split(",")
    at = lines[0].split(",").index("schema_version")
    lines[line - 1] = ",".join(cells[:at] + [version] + cells[at + 1:])
    with open(path, "w", newline="") as f:
        f.write("\n".join(lines))


def narrowed_runs(prefix, version):
    """runs.csv rewritten with `version`'s header, as that version wrote it (its rows keep their version cells)."""
    path = os.path.join(prefix, "runs.csv")
    rows = read_csv(path)
    columns = headers(RUN_SCHEMA)[version]
    with open(path, "w", newline="") as f:
        f.write(",".join(columns) + "\n")
        f.writelines(",".join(r[c] for c in columns) + "\n" for r in rows)


VERSION_CASES = {
    "newer than the suite": ("results.csv", 3, str(SCHEMA_VERSION + 2), None,
                             f"line 3: the row is schema version {SCHEMA_VERSION + 2} but the file's header is schema "
                             f"version {SCHEMA_VERSION}'s: a newer version of the suite wrote that row: update this "
                             f"checkout, or move the file aside; it was not changed"),
    "newer than its header": ("runs.csv", 2, "5", 3,
                              "line 2: the row is schema version 5 but the file's header is schema version 3's: that "
                              "row was not written under this header (files joined or edited by hand): move the file "
                              "aside, or give the row the header's version; it was not changed"),
    "no version": ("results.csv", 4, "2.5", None,
                   f"line 4: schema_version='2.5' is not a schema version (1 to {SCHEMA_VERSION}): the file is "
                   f"damaged; move it aside or repair that line; it was not changed"),
}


@pytest.mark.parametrize("case", list(VERSION_CASES))
def test_a_row_of_another_schema_version_than_its_header_is_refused_in_one_line(tmp_path, case):
    name, line, version, header, says = VERSION_CASES[case]
    prefix = two_runs(str(tmp_path))
    if header:
        narrowed_runs(prefix, header)
        set_version(os.path.join(prefix, name), 3, str(header))   # the other row agrees: only `line` is refused
    set_version(os.path.join(prefix, name), line, version)
    before = snapshot(prefix)
    rc, out, err = run_main(prefix)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in out + err
    assert err == f"error: {prefix}/{name} {says}\n"
    with pytest.raises(ResultsError) as refused:   # a run into the folder is refused before it trains
        check_prefix(prefix)
    assert str(refused.value) == f"{prefix}/{name} {says}"
    with pytest.raises(ResultsError):
        add_run(prefix, "bf16")
    assert snapshot(prefix) == before


def test_rows_of_earlier_versions_under_a_widened_header_are_read(tmp_path):
    # A file widened by an append keeps its rows' versions: blank (version 1) and older ones are the header's own.
    prefix = two_runs(str(tmp_path))
    rewrite_as_version_1(prefix)
    add_run(prefix, "bf16", (25.0, 25.5, 24.5))
    set_version(os.path.join(prefix, "runs.csv"), 4, "2")
    steps_df, runs_df = load(prefix, warn=pytest.fail)
    assert list(runs_df["schema_version"].fillna(1)) == [1, 1, 2]
    assert set(steps_df["schema_version"].fillna(1)) == {1, SCHEMA_VERSION}


# --- a PREFIX that is a symbolic link loop -------------------------------------------------------------------

@pytest.fixture
def loop(tmp_path):
    """links/a -> b -> a: ln -s a b; ln -s b a."""
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(links / "b", links / "a")
    os.symlink(links / "a", links / "b")
    yield str(links / "a")
    assert sorted(os.listdir(links)) == ["a", "b"]   # nothing was made or removed beside the links
    assert os.readlink(links / "a") == str(links / "b") and os.readlink(links / "b") == str(links / "a")


RUN = ["STEPS=2", "BATCH_SIZE=1", "MODEL=tiny", "DATA=synthetic", "DEVICE=cpu"]
TARGETS = {"rung": ["run", "fused", *RUN], "custom": ["custom", "WITH=bf16", *RUN], "all": ["all", *RUN],
           "profile": ["profile", *RUN], "scaling": ["scaling", "RUNG=fused", *RUN],
           "ablation": ["ablation", *RUN], "peers": ["peers", *RUN], "plots": ["plots"], "clean": ["clean"],
           "reset": ["reset"], "init_results": ["init_results"], "peak": ["peak"]}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("below", [False, True], ids=["loop", "inside_loop"])
def test_a_symbolic_link_loop_is_named_as_one_by_every_target_that_takes_prefix(loop, target, below, capsys):
    prefix = os.path.join(loop, "runs") if below else loop
    rc = suite([*TARGETS[target], f"PREFIX={prefix}"])
    err = capsys.readouterr().err
    where = f"passes through {loop}, a symbolic link loop" if below else "is a symbolic link loop"
    assert rc == 2 and err == (f"error: PREFIX={prefix} {where} (links that lead back to each other; ls -l shows "
                               f"where each points): remove or repoint the links, or choose another folder\n")


def test_compare_names_a_loop_among_its_folders_or_as_out(loop, tmp_path, capsys):
    other = two_runs(str(tmp_path / "other"))
    assert suite(["compare", f"PREFIXES={other} {loop}"]) == 2
    assert suite(["compare", f"PREFIXES={other} {other}2", f"OUT={loop}"]) == 2
    assert errors(capsys.readouterr().err) == [
        f"error: PREFIXES names {loop}, which is a symbolic link loop (links that lead back to each other; ls -l shows "
        f"where each points): remove or repoint the links, or choose another folder",
        f"error: OUT={loop} is a symbolic link loop (links that lead back to each other; ls -l shows where each "
        f"points): remove or repoint the links, or choose another folder"]


def test_the_reader_and_a_run_name_a_loop_outside_the_driver_too(loop):
    # plot_results.py, compare and a rung's script started by hand: the same words.
    for call in (load, check_prefix):
        with pytest.raises(ResultsError, match=r"^PREFIX=.* is a symbolic link loop \(links that lead back"):
            call(loop)


def test_make_reset_names_a_loop_and_removes_nothing(loop):
    done = make(["reset", f"PREFIX={loop}"], clean_env(), timeout=60)
    assert done.returncode == 2 and errors(done.stderr) == [
        f"error: PREFIX={loop} is a symbolic link loop (links that lead back to each other; ls -l shows where each "
        f"points): remove or repoint the links, or choose another folder"]


# --- paths full of spaces, quotes and unicode ----------------------------------------------------------------

def test_the_folder_targets_take_a_prefix_of_spaces_quotes_and_unicode(tmp_path, capfd):
    # The driver starts no shell: each path reaches its child as one word. (A word of PREFIXES holds no space:
    # PREFIXES is a list of words.)
    odd = two_runs(str(tmp_path / "runs $5 it's \"ü\" ✓ (copy)"))
    assert suite(["plots", f"PREFIX={odd}"]) == 0
    assert summary_table(odd)["tf32"]["speedup"] == "2.00x"
    one, two = two_runs(str(tmp_path / "one-'é'-\"ß\"-$HOME")), two_runs(str(tmp_path / "two-✓-`id`"))
    assert suite(["compare", f"PREFIXES={one} {two}", f"OUT={odd}"]) == 0
    assert os.path.isfile(os.path.join(odd, "compare.md"))
    assert suite(["clean", f"PREFIX={odd}"]) == 0
    assert sorted(os.listdir(odd)) == [".results.lock", "results.csv", "runs.csv"]
    assert suite(["reset", f"PREFIX={odd}"]) == 0
    assert os.listdir(odd) == []
    empty = os.path.join(odd, "new 'ü'")
    assert suite(["init_results", f"PREFIX={empty}"]) == 0
    assert sorted(os.listdir(empty)) == [".results.lock", "results.csv", "runs.csv"]
    assert not errors(capfd.readouterr().err)


def test_a_prefix_with_a_leading_dash_goes_through_every_target_that_takes_one():
    # make runs in the repository, and a PREFIX relative to it that begins with a dash must reach each child as a
    # folder, never as an option: a rung, custom, plots, compare (PREFIXES and OUT), clean, reset.
    import shutil
    import uuid
    from conftest import REPO_ROOT, clean_env, make
    name = f"-fault-test-{uuid.uuid4().hex[:8]}"
    env = dict(clean_env(), OMP_NUM_THREADS="1")
    tiny = ["STEPS=2", "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", "WARMUP=1", f"PREFIX={name}"]
    try:
        for args in (["baseline", *tiny], ["custom", "WITH=tf32", *tiny], ["plots", f"PREFIX={name}"],
                     ["compare", f"PREFIXES={name} results/h200-b16", f"OUT={name}/cmp"], ["clean", f"PREFIX={name}"]):
            done = make(args, env, timeout=300)
            assert done.returncode == 0, (args, done.stderr)
        folder = os.path.join(REPO_ROOT, name)
        assert [r["status"] for r in read_csv(os.path.join(folder, "runs.csv"))] == ["ok", "ok"]
        assert os.path.isfile(os.path.join(folder, "cmp", "compare.md"))
        assert not os.path.exists(os.path.join(folder, "summary.md"))   # clean removed the charts it drew
        done = make(["reset", f"PREFIX={name}"], env, timeout=60)
        assert done.returncode == 0 and not os.path.exists(os.path.join(folder, "runs.csv")), done.stderr
    finally:
        shutil.rmtree(os.path.join(REPO_ROOT, name), ignore_errors=True)
