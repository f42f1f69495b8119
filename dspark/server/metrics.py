"""Prometheus metrics read from the engine at scrape time (nothing to update on the hot path)."""

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from dspark.server.service import EngineService


class EngineCollector:
    def __init__(self, service: EngineService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service, engine = self.service, self.service.engine
        stats = engine.stats
        requests = CounterMetricFamily("dspark_requests", "Finished requests by finish reason",
                                       labels=["finish_reason"])
        for reason, count in sorted(service.finished.items()):
            requests.add_metric([reason], count)
        yield requests
        yield CounterMetricFamily("dspark_prompt_tokens", "Prompt tokens prefilled", value=stats.num_prompt_tokens)
        yield CounterMetricFamily("dspark_generation_tokens", "Tokens generated", value=stats.num_generated)
        yield CounterMetricFamily("dspark_draft_tokens", "Draft tokens proposed", value=stats.num_drafted)
        yield CounterMetricFamily("dspark_verified_draft_tokens", "Draft tokens sent to the target",
                                  value=stats.num_verified)
        yield CounterMetricFamily("dspark_accepted_draft_tokens", "Draft tokens accepted", value=stats.num_accepted)
        yield GaugeMetricFamily("dspark_tau", "Mean tokens per request per round (accepted + 1)", value=stats.tau)
        yield GaugeMetricFamily("dspark_acceptance_rate", "Accepted / verified draft tokens",
                                value=stats.acceptance_rate)
        yield GaugeMetricFamily("dspark_verification_budget", "Mean drafts verified per request per round",
                                value=stats.verified_per_request)
        yield GaugeMetricFamily("dspark_queue_depth", "Requests waiting for a slot", value=service.queue_depth)
        yield GaugeMetricFamily("dspark_running_requests", "Requests holding a slot", value=len(engine.running))
        yield SummaryMetricFamily("dspark_round_seconds", "Engine round time", count_value=stats.num_rounds,
                                  sum_value=stats.round_time)
