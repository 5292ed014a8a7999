// The empty unit whose build makes the tests' precompiled header (tests/CMakeLists.txt).
// SPDX-License-Identifier: Apache-2.0
