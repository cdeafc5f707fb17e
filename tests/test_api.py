"""The public API is fully annotated: every public function and method of every jaxnn module names the types of
its arguments and of what it returns, so editors and type checkers can tell users what to pass."""

import importlib
import inspect
import pkgutil

import jaxnn


def public_callables():
    for info in pkgutil.walk_packages(jaxnn.__path__, "jaxnn."):
        if info.name.rsplit(".", 1)[-1].startswith("_") and info.name.rsplit(".", 1)[-1] != "_src":
            continue  # a package's private module (jaxnn.loop._setup): its helpers are not API
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not inspect.isfunction(member) or member.__module__ != module.__name__:
                        continue  # e.g. the __init__ that typing.Protocol puts on protocol classes
                    if not attr.startswith("_") or attr == "__init__":
                        yield f"{module.__name__}.{name}.{attr}", member


def missing_annotations(fn) -> list[str]:
    sig = inspect.signature(fn)
    missing = [
        p.name
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        missing.append("return")
    return missing


def test_every_public_function_is_annotated():
    gaps = {name: missing for name, fn in public_callables() if (missing := missing_annotations(fn))}
    assert not gaps, "\n".join(f"{name}: {', '.join(missing)}" for name, missing in sorted(gaps.items()))
