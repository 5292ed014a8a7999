// tests/test_pch.hpp: the precompiled header of every test translation unit (tests/CMakeLists.txt,
// LOCKSTEP_TEST_PCH): what most tests parse and no test declares itself, parsed once per build
// instead of once per test: Catch2, the standard headers lockstep uses and Thrust (after
// lockstep's configuration, which picks Thrust's system). No lockstep declaration is in it, so a
// test sees the lockstep names it includes and no others (the umbrella header here made a test's
// own helper ambiguous with lockstep::shard). SPDX-License-Identifier: Apache-2.0
#pragma once

#include <catch2/catch.hpp>

#include "lockstep/core/config.hpp"

#include <thrust/copy.h>
#include <thrust/count.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>
#if LOCKSTEP_HAS_OPENMP
#include <thrust/system/omp/execution_policy.h>
#endif

#include <algorithm>
#include <any>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
