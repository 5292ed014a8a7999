// bench/median.hpp: the median the benchmarks report (the upper one for an even count; 0 for
// none). SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <vector>

namespace bench_stats {

/// The element at size() / 2 of the sorted values: the median, or the upper of the two middle
/// ones for an even count; 0 when there are none.
inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

} // namespace bench_stats
