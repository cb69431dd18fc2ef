"""Clusters of duplicate candidates: connected components of an edge list (scipy's csgraph)."""

from __future__ import annotations

import numpy as np


def component_labels(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Component label (int) of each of the n nodes joined by the undirected edges (u, v)."""
    # scipy is imported here: it costs ~1 s, and every `kiln prep` run registers this step module.
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if n == 0:
        return np.zeros(0, dtype=np.int64)
    graph = coo_matrix((np.ones(len(u), dtype=np.int8), (u, v)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    return labels


def components_keep_lowest(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of the nodes to keep: the lowest index of every component."""
    labels = component_labels(n, u, v)
    keep = np.zeros(n, dtype=bool)
    keep[np.unique(labels, return_index=True)[1]] = True
    return keep
