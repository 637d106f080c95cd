import collections, json, os, time
import pytest
_acc = collections.defaultdict(lambda: collections.Counter())
_cur = {"nodeid": "?"}
_installed = False

def _listener(event, duration, **kw):
    f = _cur["nodeid"].split("::")[0]
    _acc[f][event] += duration
    _acc[f][event + "#n"] += 1

def _ev(event, **kw):
    f = _cur["nodeid"].split("::")[0]
    _acc[f][event + "#n"] += 1

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _installed
    if not _installed:
        import jax.monitoring as m
        m.register_event_duration_secs_listener(_listener)
        m.register_event_listener(_ev)
        _installed = True
    _cur["nodeid"] = item.nodeid
    t0 = time.perf_counter()
    yield
    _acc[item.nodeid.split("::")[0]]["wall"] += time.perf_counter() - t0

def pytest_sessionfinish(session):
    wid = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"/tmp/jp/prof_{wid}.json", "w") as fh:
        json.dump({k: dict(v) for k, v in _acc.items()}, fh)
