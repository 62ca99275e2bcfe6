import os
import sys

# Triton's interpreter must be chosen before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Several host devices for the JAX sharding tests; set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(__file__))

import random  # noqa: E402

import pytest  # noqa: E402

from harness import new_seed, torch_configs_restored  # noqa: E402

# torch's configuration modules that tests change: restored after every test whatever the
# test did (see _torch_configs_restored).
TORCH_CONFIGS = ("torch._dynamo.config", "torch._inductor.config")
ORDER_SEED_ENV = "DLM_TEST_ORDER_SEED"


def interpreter_incompatibility(triton_version, numpy_version):
    """Why Triton's interpreter cannot run beside this NumPy, or None. Before Triton 3.7 the
    interpreter turns one-element arrays into Python ints with int(), which NumPy 2.4 made an
    error ("only 0-dimensional arrays can be converted to Python scalars" from every kernel;
    the H200 image's pair, Triton 3.6 with NumPy 2.5, is one such)."""
    from dlm_kernels._env import _release

    if _release(triton_version) < (3, 7) and _release(numpy_version)[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1, which the CPU tests "
                f"use) fails with NumPy {numpy_version}: install numpy<2.4 or triton>=3.7 (on a "
                f"GPU, TRITON_INTERPRET=0 DLM_TEST_DEVICE=cuda runs compiled kernels instead)")
    return None


def _order_seed(config):
    """The seed of this run's test order: drawn once in the controlling process (or read from
    ``DLM_TEST_ORDER_SEED``) and handed to every pytest-xdist worker, which must all collect
    the same order."""
    workerinput = getattr(config, "workerinput", None)  # set by xdist on a worker
    if workerinput is not None:
        return int(workerinput[ORDER_SEED_ENV])
    env = os.environ.get(ORDER_SEED_ENV)
    if env == "none":
        return -1  # the collection order
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, in the controlling process: each worker runs the controller's test order and
    shares its compiled-program cache."""
    node.workerinput[ORDER_SEED_ENV] = node.config.stash[ORDER_SEED]
    node.workerinput[JAX_CACHE_ENV] = os.environ[JAX_CACHE_ENV]


# XLA's compiled programs, kept on disk for this run (every worker's): tests build the same
# programs again and again (a jitted closure made afresh per test or per case compiles the
# same HLO), and XLA's CPU compile, 0.5-1 s a program, is most of a small JAX test's time.
# Keyed by the program and the compiler, so a hit is the same executable. A directory given
# in the environment is used as it is (and kept); else one is made and removed at the end.
JAX_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_MADE_CACHE = pytest.StashKey[str]()


def _share_compiled_programs(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        os.environ.setdefault(JAX_CACHE_ENV, workerinput[JAX_CACHE_ENV])
    elif JAX_CACHE_ENV not in os.environ:
        import tempfile

        os.environ[JAX_CACHE_ENV] = config.stash[_MADE_CACHE] = tempfile.mkdtemp(
            prefix="dlm-kernels-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "jax" in sys.modules:  # imported already: tell its configuration too
        sys.modules["jax"].config.update("jax_compilation_cache_dir", os.environ[JAX_CACHE_ENV])
        sys.modules["jax"].config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
    made = config.stash.get(_MADE_CACHE, None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def pytest_report_header(config):
    tier = ("full tier: every test (DLM_TEST_FULL=1)" if os.environ.get(FULL_TIER_ENV) == "1"
            else "default tier: tests/full_tier.txt's tests deselected (DLM_TEST_FULL=1 runs them)")
    seed = config.stash[ORDER_SEED]
    if seed < 0:
        return [tier, "test order: as collected"]
    return [tier, f"test order: shuffled, {ORDER_SEED_ENV}={seed} replays it"]


FULL_TIER_ENV = "DLM_TEST_FULL"
FULL_TIER_FILE = os.path.join(os.path.dirname(__file__), "full_tier.txt")


def full_tier_prefixes():
    """The test ids (or prefixes of them: a module, a class, a test's every parameter) that
    only the full tier runs (tests/full_tier.txt)."""
    with open(FULL_TIER_FILE) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return tuple(line for line in lines if line)


def _whole_suite(config):
    """Whether this run collects every test (no paths, -k or -m of its own)."""
    rootdir = str(config.rootpath)
    own = {os.path.normpath(os.path.join(rootdir, a)) for a in config.args}
    return (own <= {os.path.join(rootdir, "tests")} and not config.option.keyword
            and not config.option.markexpr)


def _full_tier(nodeid, prefixes):
    return any(nodeid == p or nodeid.startswith(p + "::") or nodeid.startswith(p + "[")
               for p in prefixes)


def pytest_collection_modifyitems(session, config, items):
    """The default run leaves out the full tier (tests/full_tier.txt: the slowest tests,
    each of which repeats on another backend, in another framework or at another size what a
    test of the default run checks); ``DLM_TEST_FULL=1`` runs every test.

    Every run takes its tests in a fresh random order (pytest-xdist's workers split them
    differently each time too), so a test that leaves global state behind for a later one
    cannot hide behind one lucky schedule. The header prints the seed; setting
    ``DLM_TEST_ORDER_SEED`` replays that order (``none``: the order of collection)."""
    prefixes = full_tier_prefixes()
    if _whole_suite(config):  # a stale line (a renamed test) would leave its test in silently
        stale = [p for p in prefixes if not any(_full_tier(i.nodeid, (p,)) for i in items)]
        if stale:
            raise pytest.UsageError(f"tests/full_tier.txt names tests that do not exist: {stale}")
    if os.environ.get(FULL_TIER_ENV) != "1":
        keep, left = [], []
        for item in items:
            (left if _full_tier(item.nodeid, prefixes) else keep).append(item)
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = keep
    seed = config.stash[ORDER_SEED]
    if seed >= 0:
        random.Random(seed).shuffle(items)


ORDER_SEED = pytest.StashKey[int]()


def pytest_configure(config):
    import importlib.metadata as md

    config.stash[ORDER_SEED] = _order_seed(config)
    _share_compiled_programs(config)

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        versions = md.version("triton"), md.version("numpy")
    except md.PackageNotFoundError:
        return
    reason = interpreter_incompatibility(*versions)
    if reason:
        raise pytest.UsageError(reason)
    import interpreter_numerics

    interpreter_numerics.install()  # bfloat16 rounded to nearest, as compiled kernels do


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Every test runs with the backends' output buffers NaN-filled before a kernel writes
    them (``dlm_kernels.testing.poisoned_outputs``): an unwritten element fails its check."""
    from dlm_kernels.testing import poisoned_outputs

    with poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def _jax_programs_traced_afresh(request):
    """A test that patches the package (``monkeypatch``) runs no JAX program traced before
    its patch, and leaves none traced under it: the package's VJPs are cached programs
    (``jax.jit`` keyed by the call's shapes and configuration, not by module constants such
    as a budget a test lowers), so JAX's caches are dropped before and after such a test. A
    test that patches in the middle drops them itself (``jax.clear_caches``)."""
    patches = "monkeypatch" in request.fixturenames and "jax" in sys.modules
    if patches:
        sys.modules["jax"].clear_caches()
    yield
    if patches:
        sys.modules["jax"].clear_caches()


@pytest.fixture(autouse=True)
def _torch_configs_restored():
    """Whatever a test does to torch's Dynamo and Inductor configuration, the next test in the
    worker starts from the values before it: by construction, not by each test's care
    (``harness.torch_configs_restored``). Tests change them through ``torch_config``."""
    with torch_configs_restored(TORCH_CONFIGS):
        yield


@pytest.fixture
def torch_config():
    """``torch_config("torch._dynamo.config", recompile_limit=64)``: torch's own
    ``config.patch`` for the rest of the test, undone at its end."""
    import contextlib
    import importlib

    with contextlib.ExitStack() as stack:
        def patch(module_name, **changes):
            stack.enter_context(importlib.import_module(module_name).patch(**changes))

        yield patch


@pytest.fixture
def compiled_loops(monkeypatch, torch_config):
    """The torch chunked backend's compiled CPU loops at every K, with room for a graph per configuration, dtype
    and shift: a worker that runs all the compiled-loop tests passes Dynamo's default limit
    of 8 graphs a function (then the eager tiles would run, and the tests that check the
    compiled path fail)."""
    from dlm_kernels.token_stats import torch_compiled as tc

    monkeypatch.setattr(tc, "COMPILE_MIN_VOCAB", 0)
    torch_config("torch._dynamo.config", recompile_limit=64)
    return tc


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(new_seed())


@pytest.fixture
def jax_triton_on_cpu(monkeypatch):
    """Load the JAX triton backend (token statistics and the sampler) against
    ``jax_triton_emulator`` (jax-triton's calling convention, kernels in the Triton
    interpreter) and let it take CPU arrays; the real modules and registry entries come back
    afterwards. Yields the token-statistics module."""
    import importlib

    import dlm_kernels._jax
    import dlm_kernels.sampling
    import dlm_kernels.token_stats
    import jax_triton_emulator
    from dlm_kernels._jax.framework import JAX

    monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_emulator)
    # (package, module): the shared jax-triton host first, then the stats module, the sampler
    modules = ((dlm_kernels._jax, "triton"), (dlm_kernels.token_stats, "jax_triton"),
               (dlm_kernels.sampling, "jax_triton"))
    names = [f"{package.__name__}.{module}" for package, module in modules]
    saved = [(sys.modules.pop(name, None), getattr(package, module, None))
             for name, (package, module) in zip(names, modules)]
    try:
        _, stats, sampler = (importlib.import_module(name) for name in names)
    finally:  # the emulated modules are used through the registries only
        for name, (package, module), (before, attribute) in zip(names, modules, saved):
            sys.modules.pop(name, None)
            if before is not None:
                sys.modules[name] = before
            if attribute is not None:
                setattr(package, module, attribute)
            elif hasattr(package, module):
                delattr(package, module)

    class OnCpu(stats.TritonJax):
        @staticmethod
        def unsupported_reason(platform):
            return None

    class SamplerOnCpu(sampler.TritonSampler):
        @staticmethod
        def unsupported_reason(platform):
            return None

    monkeypatch.setitem(JAX.token_stats.IMPLEMENTATIONS, "triton", OnCpu())
    monkeypatch.setitem(JAX.sampling.IMPLEMENTATIONS, "triton", SamplerOnCpu())
    yield stats
