"""Load balancers for routed FFNs (registered with ``BALANCERS``); see ``base.Balancer``."""
