// The Catch2 main shared by every (non-MPI) test executable. SPDX-License-Identifier: Apache-2.0
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
