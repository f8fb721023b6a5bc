"""Every component's numeric flags are checked when parsed: a bad value exits 2 with one line
that names the flag, before any server starts. (Found by a break-it pass: ``sluice router
--hold-timeout nan`` answered 500s, ``inf`` held requests for ever, ``--max-queue -1`` died
in a traceback, a negative poll interval was taken.)"""

from __future__ import annotations

import pytest

from sluice import cli


@pytest.mark.parametrize("argv, message", [
    (["router", "--hold-timeout", "nan"],
     "argument --hold-timeout: must be finite and >= 0 seconds, got nan"),
    (["router", "--hold-timeout", "inf"],
     "argument --hold-timeout: must be finite and >= 0 seconds, got inf"),
    (["router", "--hold-timeout", "-1"],
     "argument --hold-timeout: must be finite and >= 0 seconds, got -1"),
    (["router", "--hold-timeout", "soon"], "argument --hold-timeout: not a number of seconds: 'soon'"),
    (["router", "--max-queue", "-1"], "argument --max-queue: must be >= 0, got -1"),
    (["router", "--max-queue", "2.5"], "argument --max-queue: not a whole number: '2.5'"),
    (["router", "--queue-timeout", "-1"],
     "argument --queue-timeout: must be finite and > 0 seconds, got -1"),
    (["router", "--poll-interval", "0"],
     "argument --poll-interval: must be finite and > 0 seconds, got 0"),
    (["router", "--first-byte-timeout", "-1"],
     "argument --first-byte-timeout: must be finite and > 0 seconds, got -1"),
    (["router", "--slo-ttft-ms", "-5"],
     "argument --slo-ttft-ms: must be finite and >= 0 milliseconds, got -5"),
    (["router", "--max-slo-ms", "0"],
     "argument --max-slo-ms: must be finite and > 0 milliseconds, got 0"),
    (["router", "--load-factor", "0.5"], "argument --load-factor: must be finite and >= 1, got 0.5"),
    (["router", "--prefix-key-chars", "0"], "argument --prefix-key-chars: must be >= 1, got 0"),
    (["router", "--max-body-bytes", "-1"], "argument --max-body-bytes: must be >= 1, got -1"),
    (["router", "--worker", "https://w0:8001"],  # (the router speaks plain HTTP to workers)
     "argument --worker: the router reaches workers over http:// only, not 'https://w0:8001'"),
    (["up", "-f", "x.yaml", "--replicas", "-1"], "argument --replicas: must be >= 0, got -1"),
    (["up", "-f", "x.yaml", "--startup-timeout", "0"],
     "argument --startup-timeout: must be finite and > 0 seconds, got 0"),
    (["operator", "--watch-timeout", "0"], "argument --watch-timeout: must be >= 1, got 0"),
    (["operator", "--resync-seconds", "nan"],
     "argument --resync-seconds: must be finite and > 0 seconds, got nan"),
    (["worker", "--kv-cache-gib", "nan"],
     "argument --kv-cache-gib: must be finite and > 0 and <= 4096 GiB, got nan"),
    (["worker", "--kv-cache-gib", "1e308"],  # was an OverflowError after the server started
     "argument --kv-cache-gib: must be finite and > 0 and <= 4096 GiB, got 1e308"),
    (["worker", "--served-model-name="], "argument --served-model-name: must not be empty"),
    (["worker", "--device", "bogus"], "argument --device: must be cpu, cuda or cuda:N, got 'bogus'"),
    (["router", "--queue-timeout", "0"],  # was a traceback from the admission queue
     "argument --queue-timeout: must be finite and > 0 seconds, got 0"),
    (["worker", "--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["worker", "--max-num-seqs", "-4"], "argument --max-num-seqs: must be >= 1, got -4"),
    (["cascade", "calibrate", "--records", "r", "--tiers", "a,b", "--quantile", "2"],
     "argument --quantile: must be finite and >= 0 and <= 1, got 2"),
    (["cascade", "record", "--cascade", "c", "--tiers", "a,b", "--batch", "0"],
     "argument --batch: must be >= 1, got 0"),
])
def test_a_bad_number_exits_2_with_one_line_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    prog = "sluice " + " ".join(argv[:2] if argv[0] == "cascade" else argv[:1])
    assert capsys.readouterr().err == f"{prog}: error: {message} (see {prog} --help)\n"


def test_good_numbers_parse():
    """The same flags take what their help allows: 0 where 0 means none."""
    parser = cli.Parser(prog="sluice router")
    from sluice.router import app
    app.add_arguments(parser)
    args = parser.parse_args(["--hold-timeout", "0", "--max-queue", "0", "--slo-ttft-ms", "0",
                              "--poll-interval", "0.25", "--load-factor", "1"])
    assert (args.hold_timeout, args.max_queue, args.slo_ttft_ms, args.poll_interval,
            args.load_factor) == (0.0, 0, 0.0, 0.25, 1.0)
