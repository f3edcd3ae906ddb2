"""benchmarks/lockstep_trace.py's reading of one wave: times after the engine's second step, and waves that did not
split into a lone first stream and the rest left out."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import BENCHMARKS_DIR, load_benchmark_script


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))  # the script imports gateway_overhead beside it
    return load_benchmark_script("lockstep_trace", monkeypatch)


def test_a_wave_is_read_against_its_second_engine_step(script: ModuleType) -> None:
    # Sent at 10.000 s; step 1 hands out at 10.020, step 2 at 10.040; the client saw the lone stream at 10.0205 and
    # the other three at 10.0410, 10.0420 and 10.0440; the engine had written step 2 by 10.0407, the gateway relayed
    # them at 10.0402 to 10.0415.
    stamps = {
        "engine": [9.5, 10.020, 10.040, 10.060],
        "engine_written": [9.5001, 10.0201, 10.0407, 10.0601],
        "gateway": [10.0202, 10.0402, 10.0408, 10.0415],
    }
    wave = (10.0, 0.003, [10.0205, 10.0410, 10.0420, 10.0440])
    figures = script.wave_figures(wave, stamps)
    assert figures == pytest.approx(
        {
            "load generator waiting for a core (ms/wave)": 3.0,
            "step 1: first token at the client": 0.5,
            "step 2: the engine fake has written every stream's token": 0.7,
            "step 2: first stream's token at the client": 1.0,
            "step 2: median stream's token at the client": 2.0,
            "step 2: last stream's token at the client": 4.0,
            "step 2: gateway relays the first stream's token": 0.2,
            "step 2: gateway relays the median stream's": 0.8,
            "step 2: gateway relays the last stream's": 1.5,
        }
    )


def test_a_wave_whose_first_step_took_two_streams_is_left_out(script: ModuleType) -> None:
    stamps = {"engine": [10.020, 10.040], "engine_written": [10.0201, 10.0403], "gateway": []}
    assert script.wave_figures((10.0, 0.0, [10.0205, 10.0206, 10.0410]), stamps) is None


def test_a_direct_wave_has_no_relay_figures(script: ModuleType) -> None:
    stamps = {"engine": [10.020, 10.040], "engine_written": [10.0201, 10.0403], "gateway": []}
    figures = script.wave_figures((10.0, 0.0, [10.0205, 10.0410, 10.0412]), stamps)
    assert figures is not None and not any("relays" in key for key in figures)
