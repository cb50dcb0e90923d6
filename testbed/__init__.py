"""An emulated cluster on one Linux machine: hosts as network namespaces on
bridges, per-port rates and DSCP priority queues, always cleaned up."""

from gradlane.testbed.cluster import Cluster, cluster_names, remove_cluster
from gradlane.testbed.netns import clean
from gradlane.testbed.topology import Topology

__all__ = ["Cluster", "Topology", "clean", "cluster_names", "remove_cluster"]
