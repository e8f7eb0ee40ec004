"""`nearpolicy doctor`: CPU facts parsed from /proc/cpuinfo text, and the report of this machine."""

from __future__ import annotations

import pytest

from nearpolicy.doctor import Check, cpu_facts, doctor

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_cpu_facts_take_the_first_processor():
    model, flags = cpu_facts(XEON)
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert {"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"} <= flags and "fpu" in flags and len(flags) == 11


def test_a_failed_optional_check_warns_and_a_failed_required_one_fails():
    assert Check("disk", "1 GB", ok=False, required=False).line().startswith("[warn] disk")
    assert Check("llama-cpp-python", "missing", ok=False).line().startswith("[FAIL] llama-cpp-python")


@pytest.mark.slow  # engine probes in child processes: about 20 s on 2 cores
def test_doctor_reports_this_machine_and_probes_the_engine_in_child_processes(tmp_path):
    lines: list[str] = []
    code = doctor(tmp_path, probe=True, echo=lines.append)
    text = "\n".join(lines)
    assert code == 0, text
    names = [line[7:].split()[0] for line in lines]
    assert names == ["cpu", "cpu", "load", "torch", "gemm", "gemm", "memory", "roofline", "llama-cpp-python", "probe",
                     "probe", "disk", "chromium"]
    assert "AVX2 = 1" in text and "AMX_INT8 = 1" not in text  # the pinned build: AVX2 on, AMX compiled out
    probes = [line for line in lines if "probe extra_buffers=" in line]
    assert len(probes) == 2 and all(line.startswith("[ok  ]") and "decoded q4_1 in a child process" in line
                                    for line in probes)


def test_a_busy_machine_is_a_warning_with_the_load_figures():
    from nearpolicy.doctor import machine_load

    busy = machine_load(3.2, 2)
    assert (busy.ok, busy.required) == (False, False)
    assert busy.line() == ("[warn] load                     3.2 runnable processes (1-min load average) on 2 cores; "
                           "the machine is busy: timings and GEMM speed read low")
    assert machine_load(0.4, 2).line().endswith("on 2 cores, quiet") and machine_load(0.4, 2).ok
    assert machine_load(3.2, 2, running_now=0).ok and not machine_load(3.2, 2, running_now=1.5).ok
    assert not machine_load(0.4, 2, running_now=5).ok  # work that just began: the 1-min average has not seen it
    assert machine_load(0.4, 2, running_now=5).line().endswith(", 5 other tasks running now on 2 cores; the machine "
                                                               "is busy: timings and GEMM speed read low")


def test_others_running_reads_the_runnable_tasks_less_this_one(monkeypatch, tmp_path):
    from nearpolicy import doctor

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 4\nprocs_blocked 0\n")
    real_path = doctor.Path
    monkeypatch.setattr(doctor, "Path", lambda p: stat if p == "/proc/stat" else real_path(p))
    assert doctor.others_running(samples=3, interval_s=0.0) == 3.0
    for odd in ("cpu  1 2 3\n", "procs_running \n", "procs_running x\n"):  # no line, no number, not a number
        stat.write_text(odd)
        assert doctor.others_running(samples=1) is None


def test_memory_bandwidth_counts_stream_bytes(monkeypatch):
    """copy moves 2 arrays, triad 3 (STREAM's counting): with a clock that advances 1 s per reading, each kernel takes
    1 s, so 1 MiB float32 arrays read as 2 x 2^20 and 3 x 2^20 bytes/s."""
    import itertools

    import nearpolicy.engines.roofline as roofline_module  # the probe's home, shared with a run's start

    ticks = itertools.count()
    monkeypatch.setattr(roofline_module.time, "perf_counter", lambda: float(next(ticks)))
    bw = roofline_module.memory_bandwidth(mib=1, repeats=2)
    assert bw == {"copy": pytest.approx(2 * 2**20 / 1e9, rel=1e-12), "triad": pytest.approx(3 * 2**20 / 1e9, rel=1e-12)}
