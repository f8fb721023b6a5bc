"""Every metric name Sluice exports, in one place.

Worker metrics use vLLM's names so existing dashboards and KEDA triggers work unchanged;
router metrics use the ``sluice_router_`` prefix.
"""

# worker (vLLM names)
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTANCE_RATE = "vllm:spec_decode_draft_acceptance_rate"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
# no vLLM equivalent: prompt tokens of requests that have no first token yet (load report)
QUEUED_PREFILL_TOKENS = "sluice:num_queued_prefill_tokens"

# router
ROUTER_REQUESTS = "sluice_router_requests_total"
ROUTER_TTFT = "sluice_router_time_to_first_token_seconds"
ROUTER_ITL = "sluice_router_inter_token_latency_seconds"
ROUTER_E2E = "sluice_router_e2e_request_latency_seconds"
ROUTER_IN_FLIGHT = "sluice_router_in_flight_requests"
ROUTER_QUEUE_LENGTH = "sluice_router_queue_length"
ROUTER_REJECTED = "sluice_router_rejected_requests_total"
ROUTER_QUEUE_WAIT = "sluice_router_queue_wait_seconds"
ROUTER_RETRIES = "sluice_router_retries_total"
ROUTER_TTFT_PREDICTION_MAPE = "sluice_router_ttft_prediction_mape"
ROUTER_TTFT_PREDICTION_ERROR = "sluice_router_ttft_prediction_error_seconds"
ROUTER_EJECTIONS = "sluice_router_endpoint_ejections_total"
ROUTER_BROKEN_STREAMS = "sluice_router_broken_streams_total"

# router: API-key tenants (labels: the tenants of the key file)
ROUTER_TENANT_REQUESTS = "sluice_router_tenant_requests_total"
ROUTER_TENANT_TOKENS = "sluice_router_tenant_tokens_total"
ROUTER_TENANT_RATE_LIMITED = "sluice_router_tenant_rate_limited_total"

# router: demand as admission sees it (what the autoscaler reads; per model)
ROUTER_ARRIVALS = "sluice_router_arrivals_total"
ROUTER_HELD = "sluice_router_held_requests"
ROUTER_SLO_REQUESTS = "sluice_router_slo_requests_total"
ROUTER_SLO_MET = "sluice_router_slo_met_total"

# router: cascades (labels: the cascade's served name, a tier's InferenceService name)
ROUTER_CASCADE_REQUESTS = "sluice_router_cascade_requests_total"
ROUTER_CASCADE_ESCALATIONS = "sluice_router_cascade_escalations_total"
ROUTER_CASCADE_SCORE = "sluice_router_cascade_score"
ROUTER_CASCADE_WASTED_TOKENS = "sluice_router_cascade_wasted_tokens_total"
ROUTER_CASCADE_WASTED_COST = "sluice_router_cascade_wasted_cost_total"

# autoscaler (operator in Kubernetes, the supervisor in `sluice up`; per model)
AUTOSCALER_DESIRED = "sluice_autoscaler_desired_replicas"
AUTOSCALER_READY = "sluice_autoscaler_ready_replicas"
AUTOSCALER_DECISIONS = "sluice_autoscaler_decisions_total"
AUTOSCALER_DEMAND = "sluice_autoscaler_demand_rps"
AUTOSCALER_CAPACITY = "sluice_autoscaler_capacity_rps"
AUTOSCALER_ATTAINMENT = "sluice_autoscaler_slo_attainment"

# histogram buckets, seconds (vLLM's TTFT/ITL buckets, trimmed)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0)
