"""The controller's threads take turns at first imports of the ML libraries (the lock of
raycolo.actors.online.library_imports): a thread that may import them waits while another
holds the lock, and the warm-up thread holds it while it imports."""
import asyncio
import sys
import threading

from raycolo.actors.online import library_imports, state
from raycolo.actors.online.state import ControllerState


def test_in_thread_waits_for_the_import_lock_and_returns_the_result():
    ran = threading.Event()

    def work(a, b):
        ran.set()
        return a + b

    async def scenario():
        with library_imports.LIBRARY_IMPORTS:         # another thread is importing
            task = asyncio.ensure_future(ControllerState.in_thread(work, 2, 3))
            await asyncio.sleep(0.3)
            assert not ran.is_set() and not task.done()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario()) == 5 and ran.is_set()


def test_warm_up_imports_under_the_lock(monkeypatch):
    held = []
    original = library_imports.LIBRARY_IMPORTS

    class Watched:
        def __enter__(self):
            original.acquire()
            held.append(True)

        def __exit__(self, *exc):
            original.release()

    monkeypatch.setattr(state, "LIBRARY_IMPORTS", Watched())
    state._warm_imports()
    assert held == [True] and "peft" in sys.modules
