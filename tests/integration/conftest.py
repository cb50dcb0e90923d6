"""Fixtures shared by the integration tests (defined in helpers.py)."""

from tests.integration.helpers import daemon as daemon
