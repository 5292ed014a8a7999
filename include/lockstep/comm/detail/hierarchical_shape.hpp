// lockstep/comm/detail/hierarchical_shape.hpp: the shape a hierarchical communicator needs (every
// node the same local size, each node's replicas at one inter-node rank), checked on
// construction, and the plan of a split whose groups keep it. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace lockstep::detail {

/// hierarchical_communicator's construction check, collective over the whole group: every node
/// has the same local size (intra.size()) and the replicas of a node share their inter.rank()
/// and inter.size(), else errc::invalid_argument on every replica (`rank`: its rank in the whole
/// group) naming the values. `stage` carries the intra-node part's host exchange
/// (hierarchical_staging::on_host).
template <class Intra, class Inter, class Stage>
void check_hierarchical_shape(Intra& intra, Inter& inter, Stage& stage, int rank) {
    // {L, -L, node, -node, nodes, -nodes}: max over both parts gives min and max at once.
    int shape[6] = {intra.size(),  -intra.size(), inter.rank(),
                    -inter.rank(), inter.size(),  -inter.size()};
    stage.on_host(intra, std::span<const int>(shape), std::span<int>(shape),
                  [&](std::span<const int> in, std::span<int> out) {
                      intra.all_reduce(in, out, reduce_op::max);
                  });
    const bool node_agrees = shape[2] == -shape[3] && shape[4] == -shape[5];
    // {L, -L, a node disagrees}: every inter communicator reaches every node, so a node
    // whose replicas disagree is known everywhere (its own replicas name the values).
    int sizes[3] = {intra.size(), -intra.size(), node_agrees ? 0 : 1};
    inter.all_reduce(std::span<const int>(sizes), std::span<int>(sizes), reduce_op::max);
    LOCKSTEP_REQUIRE(node_agrees, errc::invalid_argument, rank, "hierarchical_communicator",
                     "the replicas of one node hold different inter-node ranks (", -shape[3],
                     " to ", shape[2], ") or sizes (", -shape[5], " to ", shape[4],
                     "): every replica of a node must be at the same inter.rank()");
    LOCKSTEP_REQUIRE(sizes[2] == 0, errc::invalid_argument, rank, "hierarchical_communicator",
                     "the replicas of another node hold different inter-node ranks or sizes "
                     "(they name them): every replica of a node must be at the same "
                     "inter.rank()");
    LOCKSTEP_REQUIRE(sizes[0] == -sizes[1], errc::invalid_argument, rank,
                     "hierarchical_communicator", "the nodes have different local sizes (",
                     -sizes[1], " to ", sizes[0],
                     "): every node needs the same number of "
                     "replicas");
}

/// What split(color, key) makes of this replica's group.
struct hierarchical_split_plan {
    /// The members of this replica's color (ranks of the parent), in the new order (key, rank).
    std::vector<int> members;
    /// The group has the shape: blocks of members, one block per node (each node once, in any
    /// order), the same local ranks in the same order in every block.
    bool fits = false;
    /// The color made non-negative (MPI and NCCL splits need that): its index among the
    /// distinct colors.
    int color_index = 0;
    /// This replica's position among the members: its rank in the group, and its intra-node
    /// split's key.
    int position = 0;
    /// This node's block among the group's: the inter-node split's key.
    int block = 0;
};

/// The plan of split(color, key) on the replica at `rank` of a group of `local_size` replicas per
/// node, at node `node`, from every replica's (color, key) (`all`: rank-major pairs).
inline hierarchical_split_plan plan_hierarchical_split(std::span<const int> all, int color,
                                                       int rank, int local_size, int node) {
    const int n = static_cast<int>(all.size() / 2);
    const int L = local_size;
    hierarchical_split_plan plan;
    // Members of my color, in the new order (key, rank).
    std::vector<int>& members = plan.members;
    for (int r = 0; r < n; ++r)
        if (all[2 * static_cast<std::size_t>(r)] == color)
            members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1];
    });
    // The shape: blocks of per_node members, one block per node (each node once, in any
    // order), the same local ranks in the same order in every block.
    std::vector<int> block_locals;
    for (int m : members)
        if (m / L == members.front() / L)
            block_locals.push_back(m % L);
    const std::size_t per_node = block_locals.size();
    bool fits = members.size() % per_node == 0;
    std::vector<int> block_nodes;
    for (std::size_t i = 0; fits && i < members.size(); ++i) {
        const int m = members[i];
        if (i % per_node == 0) {
            fits = std::find(block_nodes.begin(), block_nodes.end(), m / L) == block_nodes.end();
            block_nodes.push_back(m / L);
        }
        fits = fits && m % L == block_locals[i % per_node] && m / L == block_nodes.back();
    }
    plan.fits = fits;
    std::vector<int> colors;
    colors.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
        colors.push_back(all[2 * static_cast<std::size_t>(r)]);
    std::sort(colors.begin(), colors.end());
    colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
    plan.color_index =
        static_cast<int>(std::lower_bound(colors.begin(), colors.end(), color) - colors.begin());
    // Inside the node: the members with my color, in their new order.
    plan.position =
        static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    // Across nodes: the replicas at my local rank with my color, by node.
    plan.block = static_cast<int>(std::find(block_nodes.begin(), block_nodes.end(), node) -
                                  block_nodes.begin());
    return plan;
}

} // namespace lockstep::detail
