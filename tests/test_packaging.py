"""``pip install .`` (a wheel, not editable) gives working ``edgc-prepare-data`` and
``edgc-pretrain`` that need nothing from the source tree."""

import os
import site
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_install_runs_both_commands(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), ROOT], check=True, timeout=300)
    (wheel,) = wheels.glob("megatron_edgc-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    # The wheel, unpacked into the clean venv; its dependencies (torch, megatron-core, ...)
    # from this interpreter's site-packages, appended after it (no download, no source tree).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    purelib, str(wheel)], check=True, timeout=300)
    with open(os.path.join(purelib, "deps.pth"), "w") as fh:
        fh.write("\n".join(site.getsitepackages()) + "\n")
    # Console scripts: pip --target does not write them; make them as pip would.
    bindir = venv / "bin"
    for name, module in (("edgc-prepare-data", "megatron_edgc.training.prepare_data"),
                         ("edgc-pretrain", "megatron_edgc.training.pretrain")):
        (bindir / name).write_text(f"#!{py}\nimport sys\nfrom {module} import "
                                   f"main\nsys.exit(main())\n")
        (bindir / name).chmod(0o755)
    work = tmp_path / "work"       # outside the source tree
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(py), "-c", "import megatron_edgc, megatron_edgc.config as c; "
                            "print(megatron_edgc.__file__); print(c.DEFAULT_CONFIG)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    module_file, default_config = where.stdout.split()
    assert module_file.startswith(purelib) and default_config.startswith(purelib)
    assert os.path.isfile(default_config)
    prep = subprocess.run([str(bindir / "edgc-prepare-data"), "--tokenizer-type",
                           "CorpusBPETokenizer", "--vocab-size", "512", "--output-prefix",
                           "data/small"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert (work / "data" / "small_text_document.bin").stat().st_size > 0
    run = subprocess.run([str(bindir / "edgc-pretrain"), "--data-path",
                          "data/small_text_document", "--num-layers", "2", "--hidden-size",
                          "32", "--num-attention-heads", "2", "--seq-length", "32",
                          "--micro-batch-size", "2", "--global-batch-size", "8",
                          "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "1",
                          "--log-interval", "1", "--lr-warmup-iters", "1",
                          "--edgc-mode", "static", "--edgc-rank", "2"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "iteration      4/4" in run.stdout and "summary |" in run.stdout, run.stdout
    assert "DP compression (static): at rank 2" in run.stdout


def test_our_code_starts_without_a_warning():
    """Python 3.12 turned invalid escapes into a ``SyntaxWarning`` printed at every start:
    compiling every file of ours with warnings recorded finds none, and importing every
    module of the package warns from none of our files (megatron-core's own warnings about
    Apex/TE are not ours)."""
    import warnings

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(files) > 50
    found = []
    for name in files:
        with open(os.path.join(ROOT, name)) as fh:
            source = fh.read()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compile(source, name, "exec")
        found += [f"{name}: {w.category.__name__}: {w.message}" for w in caught]
    assert found == []
    modules = sorted({name[:-3].replace("/", ".").removesuffix(".__init__")
                      for name in files if name.startswith("megatron_edgc/")})
    code = ("import importlib, warnings\n"
            "warnings.simplefilter('always')\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines()
            if "Warning" in line and os.path.join(ROOT, "megatron_edgc") in line]
    assert ours == [], ours
