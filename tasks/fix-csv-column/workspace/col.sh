#!/bin/sh
# col.sh FILE NAME: print the values of column NAME of the CSV FILE (without the header)
IDX=$(head -1 $1 | tr ',' '\n' | grep -n $2 | cut -d: -f1)
tail -n +2 $1 | cut -d, -f$((IDX+1))
