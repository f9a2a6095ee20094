"""Prometheus metrics: the families (``families``), what is read from the daemon (``reader``), the
collector that fills the families at each scrape (``collector``) and the endpoint (``server``)."""
