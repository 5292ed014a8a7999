// Compiled into lockstep_headers_cuda: hierarchical_communicator<nccl_communicator,
// mpi_communicator> with every collective instantiated (the staged composition).
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/gpu_hierarchical_group.hpp"
#include "lockstep/comm/hierarchical.hpp"

#include <cstddef>
#include <span>

namespace lockstep {
template class hierarchical_communicator<nccl_communicator, mpi_communicator>;
template class comm_stream<hierarchical_communicator<nccl_communicator, mpi_communicator>>;
} // namespace lockstep

namespace {

using comm_type = lockstep::gpu_hierarchical_group::communicator_type;
static_assert(lockstep::communicator<comm_type>);
static_assert(lockstep::all_to_all_communicator<comm_type>);

template <class T>
[[maybe_unused]] void every_collective(comm_type& c, std::span<T> a, std::span<T> b,
                                       std::span<const std::size_t> counts) {
    c.template all_reduce<T>(a, b, lockstep::reduce_op::sum);
    c.broadcast(a, 0);
    c.template all_gather<T>(a, b);
    c.template reduce<T>(a, b, lockstep::reduce_op::max, 0);
    c.template reduce_scatter<T>(a, b, counts, lockstep::reduce_op::min);
    c.template reduce_scatter<T>(a, b, lockstep::reduce_op::sum);
    c.template all_to_all<T>(a, b);
    c.barrier();
    c.synchronize();
    (void)c.split(0, 0);
}

template void every_collective<float>(comm_type&, std::span<float>, std::span<float>,
                                      std::span<const std::size_t>);
template void every_collective<double>(comm_type&, std::span<double>, std::span<double>,
                                       std::span<const std::size_t>);
template void every_collective<int>(comm_type&, std::span<int>, std::span<int>,
                                    std::span<const std::size_t>);

void run_group(lockstep::gpu_hierarchical_group& g) {
    g.run([](comm_type& c) { c.barrier(); });
}
[[maybe_unused]] auto* const run_group_ptr = &run_group;

} // namespace
