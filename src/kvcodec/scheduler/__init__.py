"""Fetch-aware iteration-level scheduling (and a blocking policy to compare against)."""

from kvcodec.scheduler.scheduler import POLICIES, PrefixSource, Scheduler

__all__ = ["POLICIES", "PrefixSource", "Scheduler"]
