// bench/csv.hpp: the benchmarks' machine-readable output: the `--csv FILE` option and a CSV
// writer with one row per measured point. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace lockstep::bench_csv {

/// Takes `--csv FILE` out of the command line.
/// requires: argv[0..argc) are valid strings.
/// ensures: returns FILE ("" when the option is absent; the option without a value fails with
/// errc::invalid_argument); the remaining arguments keep their order and argc counts them.
inline std::string take_option(int& argc, char** argv) {
    std::string path;
    int out = 1;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--csv") == 0) {
            LOCKSTEP_REQUIRE(i + 1 < argc, errc::invalid_argument, 0, "--csv",
                             "the option needs a file name");
            path = argv[++i];
            continue;
        }
        argv[out++] = argv[i];
    }
    argc = out;
    argv[argc] = nullptr;
    return path;
}

/// One CSV field: text, quoted when it holds a comma, a quote or a line break; numbers are
/// written with 6 significant digits (%.6g).
struct cell {
    std::string text;
    cell(const char* s) : text(s) {}
    cell(std::string s) : text(std::move(s)) {}
    cell(double v) : text(format(v)) {}
    cell(int v) : text(std::to_string(v)) {}
    cell(std::size_t v) : text(std::to_string(v)) {}

private:
    static std::string format(double v) {
        char b[32];
        std::snprintf(b, sizeof b, "%.6g", v);
        return b;
    }
};

/// A CSV file with a header line; each row is flushed when written, so a run that is cut short
/// keeps what it measured. A default-constructed writer is disabled and drops every row.
class writer {
public:
    writer() = default;

    /// requires: path is empty (a disabled writer) or can be created.
    /// ensures: the file at path holds the header line `columns` (joined by commas); a file
    /// that cannot be opened fails with errc::invalid_argument naming the path and errno.
    writer(const std::string& path, std::initializer_list<const char*> columns)
        : columns_(columns.size()) {
        if (path.empty())
            return;
        file_.reset(std::fopen(path.c_str(), "w"));
        LOCKSTEP_REQUIRE(file_ != nullptr, errc::invalid_argument, 0, "--csv", "cannot write ",
                         path, ": ", std::strerror(errno));
        std::vector<cell> head;
        for (const char* c : columns)
            head.emplace_back(c);
        write(head);
    }

    /// True when rows go to a file.
    bool enabled() const { return file_ != nullptr; }

    /// requires: values.size() equals the number of columns (errc::invalid_argument otherwise).
    /// ensures: one line with the values is in the file (nothing when disabled).
    void row(std::initializer_list<cell> values) {
        LOCKSTEP_REQUIRE(values.size() == columns_, errc::invalid_argument, 0, "csv row",
                         values.size(), " values for ", columns_, " columns");
        if (enabled())
            write(std::vector<cell>(values));
    }

private:
    struct closer {
        void operator()(std::FILE* f) const { std::fclose(f); }
    };
    void write(const std::vector<cell>& values) {
        std::string line;
        for (std::size_t i = 0; i < values.size(); ++i) {
            const std::string& t = values[i].text;
            if (i > 0)
                line += ',';
            if (t.find_first_of(",\"\n") == std::string::npos) {
                line += t;
                continue;
            }
            line += '"';
            for (const char ch : t)
                line += ch == '"' ? std::string("\"\"") : std::string(1, ch);
            line += '"';
        }
        line += '\n';
        LOCKSTEP_REQUIRE(std::fputs(line.c_str(), file_.get()) >= 0 &&
                             std::fflush(file_.get()) == 0,
                         errc::internal, 0, "csv row", "write failed: ", std::strerror(errno));
    }
    std::unique_ptr<std::FILE, closer> file_;
    std::size_t columns_ = 0;
};

} // namespace lockstep::bench_csv
