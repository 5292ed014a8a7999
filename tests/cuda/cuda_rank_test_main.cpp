// The main of the multi-rank CUDA tests: launches --ranks N (default 2) rank processes of itself
// through the rank launcher (tests/support/rank_launcher.hpp). SPDX-License-Identifier: Apache-2.0
//
// Host compiler, CUDA's runtime API only. Without a CUDA device this main prints why and
// returns skip_return_code at once, launching nothing (CTest: skipped, never passed). Rank r
// drives device r % devices (tests/cuda/nccl_rank_support.hpp); with fewer devices than ranks
// every rank gets its own NCCL_HOSTID (distinct_host_ids), so NCCL counts the ranks as separate
// hosts joined over its socket transport and lets several share one GPU. Devices are counted
// before the fork; the ranks are exec'd, so they start CUDA afresh.
#include "cuda_test_main.hpp"
#include "support/rank_launcher.hpp"

#include <cstdio>
#include <stdexcept>

int main(int argc, char** argv) {
    namespace ranks = lockstep_test::ranks;
    using lockstep_test::skip_return_code;
    if (ranks::is_rank_process())
        return ranks::rank_main(argc, argv, nullptr, skip_return_code);
    ranks::launch_options options;
    try {
        options.ranks = ranks::ranks_argument(argc, argv, options.ranks);
    } catch (const std::invalid_argument& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
    }
    const int devices = lockstep_test::device_count();
    if (devices == 0) {
        std::printf("no CUDA device: the %d-rank GPU cases were not run, no rank was launched "
                    "(exit %d: skipped)\n",
                    options.ranks, skip_return_code);
        return skip_return_code;
    }
    options.distinct_host_ids = devices < options.ranks;
    std::printf("%d ranks on %d CUDA device(s)%s\n", options.ranks, devices,
                options.distinct_host_ids
                    ? ": each rank its own NCCL_HOSTID (NCCL's socket transport between them)"
                    : "");
    std::fflush(stdout);
    return ranks::rank_main(argc, argv, nullptr, skip_return_code, options);
}
