"""One strategy class for both Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch``.

The two packages ship the same code under two names, with separate classes: a Trainer of one
accepts only strategies built on its own `Strategy`. A strategy of this package is therefore
written once, as a *public* class with no Lightning base (`StaleStrategy`), and made concrete per
namespace by `concrete`: ``type(name, (PublicClass, <namespace>.<LightningBase>), {})``.

Which namespace an instance gets:

* only ``pytorch_lightning`` installed: that one, at construction;
* both installed (``pip install lightning`` brings ``pytorch_lightning`` along): the instance
  stays *pending* until the first Trainer touches it. A pending instance is registered (as an
  abstract subclass) with both namespaces' `Strategy`, so either Trainer accepts it; the first
  attribute that Lightning's own code reads from it decides the namespace (the reading module's
  name) and turns it into that namespace's concrete class, built with the arguments it was given.

The registered names (``Trainer(strategy="k_async")``) are registered in every installed
namespace's registry when this package is imported (Lightning has no plugin discovery for
strategies). Concrete classes live as attributes of this module (``<Public>__<namespace>``), so
``ddp_spawn`` can pickle them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import cache
from types import FrameType
from typing import Any

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
_KEYS = {"pytorch_lightning": "pytorch_lightning", "lightning.pytorch": "lightning"}


@cache
def installed() -> tuple[str, ...]:
    """The namespaces that can be imported here (``pytorch_lightning`` is a dependency)."""
    return tuple(ns for ns in NAMESPACES if importlib.util.find_spec(ns.split(".")[0]) is not None)


def strategies_module(namespace: str):
    return importlib.import_module(f"{namespace}.strategies")


def namespace_of(obj: Any) -> str | None:
    """The namespace an object's class comes from (e.g. a Trainer's accelerator), or None."""
    module = type(obj).__module__
    for ns in NAMESPACES:
        if module == ns or module.startswith(ns + "."):
            return ns
    return None


def _calling_namespace() -> str | None:
    """The namespace of the nearest Lightning module on the call stack (outside this package)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        for ns in NAMESPACES:
            if name == ns or name.startswith(ns + "."):
                return ns
        if not name.startswith("lightning_stale"):
            return None  # user code: the namespace is not known yet
        frame = frame.f_back
    return None


@cache
def concrete(public: type, namespace: str) -> type:
    """``public`` built on ``namespace``'s Lightning base class ``public.lightning_base``."""
    base = getattr(strategies_module(namespace), public.lightning_base)
    name = f"{public.__name__}__{_KEYS[namespace]}"
    cls = type(public.__name__, (public, base), {
        "__module__": __name__, "__qualname__": name, "__doc__": public.__doc__,
        "lightning_namespace": namespace})
    setattr(sys.modules[__name__], name, cls)
    return cls


@cache
def pending(public: type) -> type:
    """The class of ``public``'s instances whose namespace is decided by the first Trainer."""
    name = f"{public.__name__}__pending"
    cls = type(public.__name__, (public,), {
        "__module__": __name__, "__qualname__": name, "__doc__": public.__doc__,
        "__init__": _pending_init, "__getattr__": _materialize})
    for ns in installed():
        strategies_module(ns).Strategy.register(cls)
    setattr(sys.modules[__name__], name, cls)
    return cls


def new_instance(public: type) -> Any:
    """An uninitialised instance of ``public`` (called from its ``__new__``)."""
    namespaces = installed()
    cls = concrete(public, namespaces[0]) if len(namespaces) == 1 else pending(public)
    return object.__new__(cls)


def _pending_init(self: Any, *args: Any, **kwargs: Any) -> None:
    public = type(self).__mro__[1]
    # Bad options fail now, at construction, exactly as they would for a concrete instance.
    concrete(public, installed()[0])(*args, **kwargs)
    self.__dict__["_pending_arguments"] = (args, kwargs)


def _materialize(self: Any, name: str) -> Any:
    if name.startswith("__") or "_pending_arguments" not in self.__dict__:
        raise AttributeError(name)
    namespace = _calling_namespace() or installed()[0]
    args, kwargs = self.__dict__.pop("_pending_arguments")
    public = type(self).__mro__[1]
    self.__class__ = concrete(public, namespace)
    self.__init__(*args, **kwargs)
    return getattr(self, name)


def register_everywhere(public: type) -> None:
    """Register ``public``'s names in every installed namespace's strategy registry."""
    for ns in installed():
        module = strategies_module(ns)
        concrete(public, ns).register_strategies(module.StrategyRegistry)
        module.Strategy.register(public)  # issubclass(public, Strategy): LightningCLI's check


def __getattr__(name: str) -> type:
    # Unpickling a concrete or pending class (ddp_spawn) may come before any instance was made.
    public_name, _, key = name.rpartition("__")
    if not public_name or name.startswith("_") or key not in (*_KEYS.values(), "pending"):
        raise AttributeError(name)
    for module_name in ("lightning_stale.strategies.stale", "lightning_stale.strategies.simulated"):
        public = getattr(importlib.import_module(module_name), public_name, None)
        if public is not None:
            if key == "pending":
                return pending(public)
            return concrete(public, next(ns for ns, k in _KEYS.items() if k == key))
    raise AttributeError(name)
