#include "api/manifest.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// The message of the ManifestError that parsing `text` throws.
std::string ParseError(const std::string& text) {
  try {
    ParseManifestText(text, "job.yaml");
  } catch (const ManifestError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Manifest, ScalarsAreTypedAsKubectlTypesThem) {
  const auto docs = ParseManifestText(R"(
int: 8
negative: -3
hex: 0x1F
float: 6.0e-4
dot: .5
bool_yes: yes
bool_off: Off
quoted_int: "8"
single_quoted: 'true'
explicit_str: !!str 12
null_tilde: ~
empty:
word: gpt2-124m
version: 1.2.3
inf: .inf
)",
                                      "t.yaml");
  ASSERT_EQ(docs.size(), 1u);
  const Json& o = docs[0].object;
  EXPECT_TRUE(o["int"].is_number_integer());
  EXPECT_EQ(o["int"], 8);
  EXPECT_EQ(o["negative"], -3);
  EXPECT_EQ(o["hex"], 31);
  EXPECT_DOUBLE_EQ(o["float"].get<double>(), 6.0e-4);
  EXPECT_DOUBLE_EQ(o["dot"].get<double>(), 0.5);
  EXPECT_EQ(o["bool_yes"], true);
  EXPECT_EQ(o["bool_off"], false);
  EXPECT_EQ(o["quoted_int"], "8");
  EXPECT_EQ(o["single_quoted"], "true");
  EXPECT_EQ(o["explicit_str"], "12");
  EXPECT_TRUE(o["null_tilde"].is_null());
  EXPECT_TRUE(o["empty"].is_null());
  EXPECT_EQ(o["word"], "gpt2-124m");
  EXPECT_EQ(o["version"], "1.2.3");
  EXPECT_TRUE(std::isinf(o["inf"].get<double>()));
}

TEST(Manifest, SeveralDocumentsKeepTheirOrderAndLines) {
  const auto docs = ParseManifestText("---\na: 1\n---\n\n---\nb: 2\nc: 3\n---\n", "multi.yaml");
  ASSERT_EQ(docs.size(), 2u);  // the empty documents are skipped
  EXPECT_EQ(docs[0].object, Json({{"a", 1}}));
  EXPECT_EQ(docs[0].index, 0);
  EXPECT_EQ(docs[0].line, 2);
  EXPECT_EQ(docs[1].object, Json({{"b", 2}, {"c", 3}}));
  EXPECT_EQ(docs[1].index, 1);
  EXPECT_EQ(docs[1].line, 6);
}

TEST(Manifest, MalformedYamlGetsLineAndColumn) {
  EXPECT_EQ(ParseError("a: 1\n  b: 2\n"), "job.yaml:2:4: illegal map value");
  EXPECT_EQ(ParseError("spec:\n  nodes: b: c\n").rfind("job.yaml:2:", 0), 0u);
  EXPECT_EQ(ParseError("a: 1\n\tb: 2\n"), "job.yaml:2:1: illegal tab when looking for indentation");
  EXPECT_EQ(ParseError("a: 1\nb: {x: 1\nc: 2\n").rfind("job.yaml:3:", 0), 0u);
}

// yaml-cpp 0.7 loops forever on these by itself (yaml-cpp issue 1040).
TEST(Manifest, StrayCommaIsAnErrorNotAHang) {
  EXPECT_EQ(ParseError(","), "job.yaml:1:1: unexpected character: no YAML node can start here");
  EXPECT_EQ(ParseError("\n, A p2%").rfind("job.yaml:2:1: ", 0), 0u);
  EXPECT_EQ(ParseError("a: 1\n---\n,\n").rfind("job.yaml:3:1: ", 0), 0u);
}

TEST(Manifest, KeysMustBePlainStrings) {
  EXPECT_NE(ParseError("? [a]\n: 1\n").find("map keys must be plain strings"), std::string::npos);
  EXPECT_NE(ParseError("a: &x 1\n*x : 2\n").find("map keys must be plain strings"), std::string::npos);
}

TEST(Manifest, AliasesCopyTheirAnchor) {
  const auto docs = ParseManifestText("base: &b {gpu: 8}\nother: *b\nlist: &l [1, *b]\nagain: *l\n", "a.yaml");
  const Json expected = {{"gpu", 8}};
  EXPECT_EQ(docs[0].object["other"], expected);
  EXPECT_EQ(docs[0].object["again"], Json::array({1, expected}));
}

TEST(Manifest, DuplicateKeysAreErrorsWithTheirPosition) {
  const std::string message = ParseError("spec:\n  nodes: 1\n  nodes: 2\n");
  EXPECT_NE(message.find("job.yaml:3:3: duplicate key \"nodes\""), std::string::npos) << message;
}

TEST(Manifest, MalformedJsonGetsLineAndColumn) {
  const std::string message = ParseError("{\n  \"spec\": {\n    \"nodes\": 1,\n  }\n}\n");
  EXPECT_EQ(message.rfind("job.yaml:4:3:", 0), 0u) << message;
}

TEST(Manifest, JsonNumberTooLargeIsAnError) {
  EXPECT_EQ(ParseError("{\"a\": 1e999}"), "job.yaml: number overflow parsing '1e999'");
}

TEST(Manifest, JsonArraysAndListsExpandIntoDocuments) {
  const auto array = ParseManifestText(R"([{"a": 1}, {"b": 2}])", "a.json");
  ASSERT_EQ(array.size(), 2u);
  EXPECT_EQ(array[1].object, Json({{"b", 2}}));
  const auto list = ParseManifestText("kind: List\nitems:\n- {a: 1}\n- {b: 2}\n- {c: 3}\n", "l.yaml");
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[2].index, 2);
  EXPECT_EQ(list[2].object, Json({{"c", 3}}));
}

TEST(Manifest, HostileInputIsBounded) {
  // Billion laughs: nine levels of ten aliases would expand to 10^9 values.
  std::string laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 9; ++i) {
    laughs += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int j = 0; j < 10; ++j) laughs += std::string(j ? ", " : "") + "*a" + std::to_string(i - 1);
    laughs += "]\n";
  }
  EXPECT_NE(ParseError(laughs).find("too many values"), std::string::npos);
  // Fewer aliases, but of a long string: bounded by bytes, not only by count.
  std::string long_laughs = "s: &s " + std::string(4000, 'x') + "\nl0: &l0 [*s, *s, *s, *s]\n";
  for (int i = 1; i <= 8; ++i) {
    const std::string prev = "*l" + std::to_string(i - 1);
    long_laughs += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " [" + prev + ", " + prev + ", " + prev + ", " + prev + "]\n";
  }
  EXPECT_NE(ParseError(long_laughs).find("too many values"), std::string::npos);
  EXPECT_NE(ParseError(std::string(100, '[') + std::string(100, ']')).find("too deep"), std::string::npos);
  EXPECT_NE(ParseError("a: " + std::string(100, '[') + std::string(100, ']')).find("deeper than"), std::string::npos);
  EXPECT_NE(ParseError(std::string("a: 1\0b", 6)).find("NUL"), std::string::npos);
  EXPECT_NE(ParseError(std::string(kMaxManifestBytes + 1, ' ')).find("larger than"), std::string::npos);
}

TEST(Manifest, InvalidUtf8IsRejectedWithItsPosition) {
  EXPECT_EQ(ParseError("a: 1\nb: ab\x9e\n"), "job.yaml:2:6: is not valid UTF-8");
  EXPECT_EQ(ParseError("a: \xc0\xaf\n"), "job.yaml:1:4: is not valid UTF-8");      // overlong '/'
  EXPECT_EQ(ParseError("a: \xed\xa0\x80\n"), "job.yaml:1:4: is not valid UTF-8");  // a surrogate
  EXPECT_EQ(ParseError("a: \xf0\x9f\x98"), "job.yaml:1:4: is not valid UTF-8");     // truncated
  EXPECT_EQ(ParseManifestText("a: \"gr\xc3\xbc\xc3\x9f \xf0\x9f\x98\x80\"\n", "u.yaml")[0].object["a"],
            "gr\xc3\xbc\xc3\x9f \xf0\x9f\x98\x80");
}

TEST(Manifest, MissingFileIsNamed) {
  try {
    ReadManifestFile("/nonexistent/job.yaml");
    FAIL() << "no error";
  } catch (const ManifestError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/job.yaml: cannot open"), std::string::npos) << e.what();
  }
}

// A pipe is read to its end (`meshtrain validate <(helm template ...)`). A FIFO no one
// holds open for writing reads as empty at once, where an open that waited for a writer
// would hang forever; a directory is refused by name.
TEST(Manifest, APipeIsReadAFifoWithoutWriterIsEmptyADirectoryIsRefused) {
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  const std::string text = "a: 1\n---\nb: [2, 3]\n";
  ASSERT_EQ(::write(ends[1], text.data(), text.size()), ssize_t(text.size()));
  ::close(ends[1]);
  const std::string pipe_path = "/proc/self/fd/" + std::to_string(ends[0]);
  const std::vector<ManifestDocument> documents = ReadManifestFile(pipe_path);
  ::close(ends[0]);
  ASSERT_EQ(documents.size(), 2u);
  EXPECT_EQ(documents[1].object["b"][1], 3);

  const std::filesystem::path fifo =
      std::filesystem::temp_directory_path() / ("meshtrain_manifest_fifo_" + std::to_string(::getpid()));
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(ReadManifestFile(fifo.string()).empty());
  try {
    LoadTrainingJobs(fifo.string());
    ADD_FAILURE() << "no error for an empty FIFO";
  } catch (const ManifestError& e) {
    EXPECT_EQ(std::string(e.what()), fifo.string() + ": holds no documents");
  }
  std::filesystem::remove(fifo);

  const std::string directory = std::filesystem::temp_directory_path().string();
  try {
    ReadManifestFile(directory);
    ADD_FAILURE() << "no error for a directory";
  } catch (const ManifestError& e) {
    EXPECT_EQ(std::string(e.what()), directory + ": is a directory, not a manifest file");
  }
}

TEST(Manifest, ACheckedJobKeepsTheObjectAsWritten) {
  const Json object = ReadManifestFile("examples/gpt2-tiny-local.yaml").at(0).object;
  const CheckedJob job = CheckTrainingJob(object, "job.yaml", 0);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job.written, object);
}

TEST(Manifest, LoadTrainingJobsChecksEveryDocument) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "meshtrain_manifest_test.yaml";
  {
    std::ofstream out(path);
    out << "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other}\n---\n";
    std::ifstream tiny("examples/gpt2-tiny-local.yaml");
    out << tiny.rdbuf();
  }
  const auto jobs = LoadTrainingJobs(path.string());
  std::filesystem::remove(path);
  ASSERT_EQ(jobs.size(), 2u);
  ASSERT_FALSE(jobs[0].ok());
  EXPECT_EQ(jobs[0].errors[0].ToString(), "apiVersion: must be \"meshtrain.dev/v1alpha1\", got \"v1\"");
  EXPECT_TRUE(jobs[1].ok());
  EXPECT_EQ(jobs[1].document, 1);
  EXPECT_NE(jobs[1].Where().find("(document 2) TrainingJob \"gpt2-tiny-local\""), std::string::npos);
}

TEST(Manifest, ANonObjectDocumentIsAnError) {
  const CheckedJob job = CheckTrainingJob(ParseManifestText("- a\n- b\n", "list.yaml").at(0).object, "list.yaml", 0);
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.errors[0].message, "must be an object, got a list");
}

}  // namespace
}  // namespace meshtrain::api
