"""The package's imports flow one way (docs/layout.md), read from the source with ``ast``:

    front-ends (training/, megatron_lm/) → runtime/ → patches/, control/ → compression/

config.py and model_shapes.py are the front-ends' shared configuration: they import
compression/ only, and config.py reaches into training/ only inside the functions that
validate the trainer's own sections (its data and checkpoint files). control/ and
compression/ are pure: no megatron, no torch.distributed. Every import counts: relative
ones and those inside functions.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_edgc"

#: Layer of a module, by the longest matching prefix of its dotted name.
LAYERS = {
    "megatron_edgc": "root",
    "megatron_edgc.compression": "compression",
    "megatron_edgc.control": "control",
    "megatron_edgc.patches": "patches",
    "megatron_edgc.runtime": "runtime",
    "megatron_edgc.config": "config",
    "megatron_edgc.model_shapes": "config",
    "megatron_edgc.training": "training",
    "megatron_edgc.megatron_lm": "megatron_lm",
    "megatron_edgc.megatron_lm_cpu": "megatron_lm",   # the old name of megatron_lm.cpu
}
#: What each layer may import (besides itself and the root package).
MAY_IMPORT = {
    "root": set(),
    "compression": set(),
    "control": {"compression"},
    "patches": {"compression"},
    "runtime": {"patches", "control", "compression"},
    "config": {"compression"},
    "training": {"runtime", "patches", "control", "compression", "config"},
    "megatron_lm": {"runtime", "patches", "control", "compression", "config"},
}
#: Imports against the flow that are allowed, inside functions only: the trainer's own
#: sections of config.py validate its tokenizer and checkpoint files.
LAZY_EXCEPTIONS = {
    ("megatron_edgc.config", "megatron_edgc.training.tokenizer"),
    ("megatron_edgc.config", "megatron_edgc.training.checkpoint_files"),
}
#: Outside imports a pure layer may not make: no megatron, no process groups.
PURE = {"compression", "control"}
IMPURE_IMPORTS = ("megatron", "torch.distributed")


def package_modules() -> dict:
    """``{dotted module name: path}`` of every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def imports_of(module: str, source: str, is_package: bool, known: set) -> list:
    """``(imported module, line, inside a function)`` for every import statement of
    ``module``: absolute and relative, at module level and inside functions. ``from X
    import Y`` names X.Y when that is a module of ``known``, else X."""
    tree = ast.parse(source)
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    out.append((target if target in known else base, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return out


def layer_of(module: str):
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def violations(module: str, imports: list) -> list:
    """What in ``imports`` (from :func:`imports_of`) breaks the one-way flow."""
    layer, bad = layer_of(module), []
    for target, line, in_function in imports:
        where = f"{module}:{line} imports {target}"
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            other = layer_of(target)
            if other is None:
                bad.append(f"{where}: a module no layer holds")
            elif other not in MAY_IMPORT[layer] | {layer, "root"} and not (
                    in_function and (module, target) in LAZY_EXCEPTIONS):
                bad.append(f"{where}: {layer}/ may not import {other}/")
        elif layer in PURE and any(target == p or target.startswith(p + ".")
                                   for p in IMPURE_IMPORTS):
            bad.append(f"{where}: {layer}/ is pure (no megatron, no process groups)")
    return bad


def all_imports() -> dict:
    modules = package_modules()
    out = {}
    for module, path in modules.items():
        with open(path) as fh:
            out[module] = imports_of(module, fh.read(), path.endswith("__init__.py"),
                                     set(modules))
    return out


def test_imports_flow_one_way():
    found = all_imports()
    unplaced = sorted(m for m in found if layer_of(m) is None)
    assert unplaced == [], f"modules in no layer (add them to LAYERS): {unplaced}"
    assert {layer_of(m) for m in found} == set(MAY_IMPORT)
    bad = [v for module, imports in sorted(found.items()) for v in violations(module, imports)]
    assert bad == [], "\n".join(bad)


def test_the_check_sees_relative_and_function_level_imports():
    known = set(package_modules())
    source = ("import torch\n"
              "from . import rank_model\n"
              "def decide():\n"
              "    from ..training import loop\n"
              "    import megatron_edgc.megatron_lm\n"
              "    from megatron.core import mpu\n")
    imports = imports_of("megatron_edgc.control.controller", source, False, known)
    assert imports == [("torch", 1, False), ("megatron_edgc.control.rank_model", 2, False),
                       ("megatron_edgc.training.loop", 4, True),
                       ("megatron_edgc.megatron_lm", 5, True), ("megatron.core", 6, True)]
    bad = violations("megatron_edgc.control.controller", imports)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "control/ may not import training/", "control/ may not import megatron_lm/",
        "control/ is pure (no megatron, no process groups)"]
    # the trainer's lazy exception holds inside functions of config.py only
    lazy = [("megatron_edgc.training.tokenizer", 9, True)]
    assert violations("megatron_edgc.config", lazy) == []
    assert violations("megatron_edgc.config", [("megatron_edgc.training.tokenizer", 9, False)])
    assert violations("megatron_edgc.model_shapes", lazy)


def test_the_plug_in_loads_nothing_of_the_trainer():
    """What importing the Megatron-LM plug-in (and the runtime) executes: the module-level
    imports, followed through the package, parents included; no training/ among them."""
    found = all_imports()
    for start in ("megatron_edgc.megatron_lm", "megatron_edgc.runtime.step"):
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            parts = module.split(".")
            for n in range(1, len(parts) + 1):
                name = ".".join(parts[:n])
                if name in found and name not in seen:
                    seen.add(name)
                    todo += [t for t, _, lazy in found[name] if not lazy]
        assert "megatron_edgc.config" in seen if start.endswith("megatron_lm") else \
            "megatron_edgc.runtime.driver" in seen   # the walk does follow imports
        assert sorted(m for m in seen if layer_of(m) == "training") == [], start
