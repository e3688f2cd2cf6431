#include "cli/commands.h"

int main(int argc, char** argv) { return meshtrain::cli::Main(argc, argv); }
