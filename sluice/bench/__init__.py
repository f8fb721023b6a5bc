"""`sluice bench`: a load generator and report for any OpenAI-compatible endpoint.

workload.py (prompts, lengths, JSONL, traces) → schedule.py (open-loop arrivals) →
runner.py (closed/open loop) → client.py (one streamed request → RequestRecord) →
report.py (statistics, goodput, cost, table, JSON, plots); cli.py wires the command.
"""
