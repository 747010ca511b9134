"""The parts of benchmarks/soak.py (the command line), imported as `soak_parts` with
benchmarks/ on sys.path, as the script puts it there.

    run.py            one run from start to finish: the phases, the result dict
    supervisor.py     the server restarted whenever it exits; its `inferengine serve` command
    engine_kill.py    SIGKILL the engine core midway; the exit, the restart, the kill window
    clients.py        the client loops, the warm pass, the progress line
    request_kinds.py  one handler per traffic kind (what it sends, how it checks the answer)
    traffic.py        the clients' shared state, their HTTP calls, the per-request guard
    payloads.py       the traffic kinds and weights, prompts, schemas, tools, bad inputs
    server_probes.py  /metrics and /stats: idle or not, KV tokens written, the end state
    rss.py            the server tree's RSS: samples, baselines, growth
    outcomes.py       a request's Record, its class, counts and latencies
    checks.py         the pass/fail checks
    report.py         the server log tails and the printed summary
    clock.py          run-relative log lines and sleeps
"""
