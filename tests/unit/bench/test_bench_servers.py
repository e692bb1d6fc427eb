"""bench/servers.py's start-up wait: a server counts as started only once all of it is up."""

import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import generate_http, servers  # noqa: E402
from neuron_serve.serve.ports import free_port  # noqa: E402

# Answers every POST at once, as a model's app does, and logs the last start-up line later,
# as `neuron-serve deploy` does once the server app is up too; its /metrics says a model is left to compile
# until 1.5 s after that line, as a replica's background compile does.
LATE_LINE = textwrap.dedent("""
    import http.server, sys, threading, time
    started = time.monotonic()
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            pending = 1 if time.monotonic() < started + float(sys.argv[2]) + 1.5 else 0
            body = f'neuron_serve_compiled_models{{model="x",state="pending"}} {pending}.0\\n'.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(float(sys.argv[2]))
    print(sys.argv[3], flush=True)
    time.sleep(60)
""")


def test_a_server_whose_model_answers_early_is_started_only_at_its_ready_line_and_measured_once_compiled(tmp_path):
    port, delay = free_port(), 2.0
    spec = servers.ServerSpec("late", "late", [sys.executable, "-c", LATE_LINE, str(port), str(delay),
                                               "serving x on http://127.0.0.1/v2 (metrics: /metrics)"], port,
                              startup_s=30, ready_line=servers.READY_LINE)
    server = servers.Server(spec, tmp_path)
    try:
        seconds = server.wait_ready({"x": (b"{}", {"Content-Type": "application/json"})})
        assert delay <= seconds < delay + 1.5  # the seconds to ready, not to the end of the compile
        assert servers.READY_LINE in server.log_path.read_text()
        assert time.monotonic() - server.started >= delay + 1.5  # returned once nothing was left to compile
    finally:
        server.stop()


def test_neuron_serve_is_awaited_to_its_last_start_up_line_in_every_benchmark(tmp_path):
    cli = (ROOT / "neuron_serve" / "cli.py").read_text()
    assert servers.READY_LINE in cli  # the line `neuron-serve deploy` prints once every app is up
    assert servers.specs()["neuron-serve"].ready_line == servers.READY_LINE
    model_dir = tmp_path / "model"  # what specs() reads of a model directory (make llm-example writes one)
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"vocab_size": 1024}')
    (model_dir / "generation_config.json").write_text('{"eos_token_id": 1}')
    spec, _, _ = generate_http.specs(model_dir, tmp_path / "llm.yaml")["neuron-serve"]
    assert spec.ready_line == servers.READY_LINE
