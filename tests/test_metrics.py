import time

import pytest
import torch

from llama_ddp.metrics import Throughput, gpu_peak_flops, measure_matmul_flops, mfu, peak_flops


def test_mfu_is_achieved_over_peak():
    assert mfu(6e9, 1000.0, 12e12) == pytest.approx(0.5)
    assert mfu(6e9, 1000.0, 0.0) == 0.0


def test_gpu_peak_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835e12  # not the SXM peak
    assert gpu_peak_flops("NVIDIA H200 NVL", torch.bfloat16) == 835e12
    assert gpu_peak_flops("NVIDIA L40", torch.bfloat16) == 181e12  # not "L4"
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == 362e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_peak_override_and_cpu_measurement():
    assert peak_flops(torch.device("cpu"), torch.float32, 2.5) == 2.5e12
    measured = measure_matmul_flops(size=256, trials=2, seconds=0.02)
    assert 1e8 < measured < 1e14


def test_throughput_leaves_out_paused_time():
    t = Throughput()
    t.add(1000)
    with t.paused():  # an evaluation: 0.3 s that are not training
        time.sleep(0.3)
    assert t.read() > 1000 / 0.1  # counted over the unpaused microseconds, not over 0.3 s
    t.add(500)
    time.sleep(0.05)
    assert 500 / 0.5 < t.read() <= 500 / 0.05  # the window restarts at each read


def test_mfu_never_exceeds_100_percent_when_the_measured_peak_read_low(monkeypatch):
    from llama_ddp import metrics

    readings = iter([1e9, 2e9])  # start-up reading during a busy spell, then a second one
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: next(readings))
    peak = metrics.Peak(torch.device("cpu"), torch.float32, None, devices=1)
    assert peak.flops == 1e9
    assert peak.mfu(1e6, 4000.0) == 1.0  # 4 GFLOP/s achieved: above both readings
    assert peak.flops == 4e9  # never below what the run achieved
    assert peak.mfu(1e6, 2000.0) == pytest.approx(0.5)
    given = metrics.Peak(torch.device("cpu"), torch.float32, 0.001, devices=2)  # --peak-tflops
    assert given.flops == 2e9 and given.mfu(1e6, 1000.0) == pytest.approx(0.5)


def test_a_torn_last_line_is_dropped_and_other_damage_is_an_error(tmp_path, capsys):
    from llama_ddp.errors import UserError
    from llama_ddp.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_records(path) == [{"step": 1, "loss": 2.0}]
    assert "dropping its torn last line" in capsys.readouterr().err
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(UserError, match="line 1 is not JSON"):
        read_records(path)
