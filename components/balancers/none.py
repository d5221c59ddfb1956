"""No load balancing: routing follows the router scores alone."""

from __future__ import annotations

from dataclasses import dataclass

from components.balancers.base import Balancer
from components.config import ComponentConfig
from components.registry import BALANCERS


@dataclass
class NoBalancerConfig(ComponentConfig):
    name: str = "none"


@BALANCERS.register("none", NoBalancerConfig)
class NoBalancer(Balancer):
    """No auxiliary loss and no bias update."""
